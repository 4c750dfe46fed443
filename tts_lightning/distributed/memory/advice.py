"""What makes a plan that does not fit fit: options tried cheapest first, each on top of the last."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

import torch

from tts_lightning.distributed.memory.activations import _checkpointed
from tts_lightning.distributed.memory.settings import PlanSettings
from tts_lightning.distributed.memory.shapes import TEXT_EMBEDDING
from tts_lightning.model.optimizers import OPTIMIZERS, weights_dtype
from tts_lightning.model.parameters import matches

GiB = 2**30
LEANER_OPTIMIZERS = (
    ("adamw8bit", "8-bit AdamW moments: ~10 bytes per trained parameter instead of 16"),
    ("bf16_sr_adamw8bit", "bf16 weights with stochastic rounding and 8-bit moments: ~6 bytes"),
)


class Plan(Protocol):  # what the advice reads of a `MemoryPlan`
    total: int
    fits: bool


def advise(plan: Plan, settings: PlanSettings, plan_for: Callable[[PlanSettings], Plan]) -> list[str]:
    """Options that make ``plan`` fit, cheapest first, applied cumulatively until it fits;
    ``plan_for`` plans the same model with other settings."""
    advice: list[str] = []
    current = plan

    def attempt(text: str, **change) -> bool:
        nonlocal current, settings
        settings = replace(settings, **change)
        trial = plan_for(settings)
        advice.append(
            f"{text}: {current.total / GiB:.1f} -> {trial.total / GiB:.1f} GiB per GPU"
            + (" (fits)" if trial.fits else "")
        )
        current = trial
        return trial.fits

    if _checkpointed(settings.activation_checkpointing) != (True, True) and attempt(
        "turn on activation checkpointing (strategy activation_checkpointing_policy: both "
        "decoder-layer classes; costs ~30% more compute)",
        activation_checkpointing=True,
    ):
        return advice
    if (
        settings.sharding != "FULL_SHARD"
        and settings.gpus > 1
        and attempt(
            "use reshard_after_forward: true" if settings.fsdp2 else "use sharding_strategy FULL_SHARD",
            sharding="FULL_SHARD",
        )
    ):
        return advice
    trained_text = settings.freeze  # before the advice freezes the text embedding, if it does
    if (
        settings.adapter is None
        and not matches(TEXT_EMBEDDING + ".weight", settings.freeze)
        and attempt(
            f"freeze {TEXT_EMBEDDING} (model.freeze; 311M parameters in the released models, rarely "
            "worth training for a new voice)",
            freeze=[*settings.freeze, TEXT_EMBEDDING],
        )
    ):
        return advice
    # Leaner optimizer state (torchao), from the one measured as good as fp32 AdamW on the tiny demo
    # (8-bit moments) to the leanest (bf16 weights too; +0.2% validation loss there). adamw4bit is
    # left out: it trains slower (CAVEATS).
    if settings.adapter is None:
        for name, what in LEANER_OPTIMIZERS:
            if OPTIMIZERS.index(name) <= OPTIMIZERS.index(settings.optimizer):
                continue
            bf16 = weights_dtype(name) == torch.bfloat16
            precision = "bf16-mixed" if bf16 else settings.precision
            also = " and trainer.precision bf16-mixed" if precision != settings.precision else ""
            if attempt(f"use model.optimizer {name}{also} ({what})", optimizer=name, precision=precision):
                # The optimizer may make it fit without the freeze advised before it.
                if settings.freeze != trained_text and (alone := plan_for(replace(settings, freeze=trained_text))).fits:
                    advice.append(
                        f"or, {TEXT_EMBEDDING} trained too (not frozen), model.optimizer {name}{also}: "
                        f"{alone.total / GiB:.1f} GiB per GPU (fits)"
                    )
                return advice
    # More GPUs: an alternative, not applied to the steps that follow.
    for n in (2, 4, 8, 16, 32, 64, 128):
        if n > settings.gpus:
            trial = plan_for(replace(settings, gpus=n, sharding="FULL_SHARD"))
            if trial.fits:
                advice.append(f"or use {n} GPUs with FULL_SHARD: {trial.total / GiB:.1f} GiB per GPU (fits)")
                break
    if not settings.cpu_offload and attempt(
        "turn on cpu_offload (parameters, gradients and AdamW state in host RAM; much slower steps)", cpu_offload=True
    ):
        return advice
    lo, hi = 0, settings.micro_batch_frames
    while hi - lo > 1:  # the largest micro-batch that fits
        mid = (lo + hi) // 2
        if plan_for(replace(settings, micro_batch_frames=mid)).fits:
            lo = mid
        else:
            hi = mid
    if lo >= 1:
        attempt(
            f"lower data.max_frames_per_batch to {lo} (raise accumulate_grad_batches to keep the global batch)",
            micro_batch_frames=lo,
        )
    else:
        advice.append("it does not fit even with all of the above: use GPUs with more memory")
    return advice
