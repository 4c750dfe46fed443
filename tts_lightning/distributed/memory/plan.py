"""The plan: per-GPU bytes of one training step (`plan_memory`, `MemoryPlan`), the speech tokenizer's
size, and the advice that makes a plan fit (`_advice`)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from tts_lightning.distributed.memory.activations import _activation_bytes, _checkpointed
from tts_lightning.distributed.memory.presets import resolve_config
from tts_lightning.distributed.memory.shapes import LAYOUTS, TEXT_EMBEDDING, Unit, model_shape
from tts_lightning.model.parameters import DEFAULT_FREEZE, matches

__all__ = [
    "CUDA_OVERHEAD_BYTES",
    "GiB",
    "PRECISIONS",
    "SHARDINGS",
    "MemoryPlan",
    "plan_memory",
    "speech_tokenizer_bytes",
]

GiB = 2**30
CUDA_OVERHEAD_BYTES = 1 * GiB  # CUDA context + library workspaces + allocator fragmentation: a constant
SHARDINGS = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
PRECISIONS = ("bf16-mixed", "32-true")


@dataclass
class MemoryPlan:
    """Bytes per GPU (host memory per GPU process for ``host_memory``)."""

    model: str
    gpus: int
    gpu_memory: int
    sharding: str
    precision: str
    activation_checkpointing: bool
    cpu_offload: bool
    freeze: list[str]
    micro_batch_frames: int
    total_parameters: int
    trainable_parameters: int
    parameters: int  # persistent fp32 (master) parameters on the GPU
    gradients: int  # persistent fp32 sharded gradients on the GPU
    optimizer_states: int  # AdamW exp_avg + exp_avg_sq, fp32
    largest_gathered_unit: int  # biggest non-root FSDP unit, full, in the compute dtype
    root_unit: int  # the root unit, full, in the compute dtype (gathered for the whole step)
    gathered: int  # transient unsharded parameters and gradients at the peak
    activations: int  # at the peak (zero-ish in the end-of-backward phase)
    overhead: int
    total: int
    fits: bool
    headroom: int
    host_memory: int  # per GPU process, with cpu_offload
    peak_phase: str
    units: int
    largest_unit_name: str = ""
    samples: bool = False  # SpeakerSamplesCallback on: rank 0's sampling phase is planned too
    samples_model: int = 0  # rank 0: the generation copy of the model, compute dtype
    samples_cache: int = 0  # rank 0: the talker's KV cache for all sampled rows
    speech_tokenizer: int = 0  # rank 0: the speech tokenizer on the GPU while it decodes (fp32)
    samples_total: int = 0  # rank 0 at the sampling peak (training activations are gone then)
    adapter: dict | None = None  # LoRA settings (`tts_lightning.model.lora.LoRASettings`), if any
    layout: str = "fsdp1"  # "fsdp1" (`Qwen3TTSFSDPStrategy`) or "fsdp2" (`Qwen3TTSFSDP2Strategy`)
    notes: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states

    def table(self) -> str:
        g = lambda x: f"{x / GiB:8.2f}"  # noqa: E731
        ckpt = "on" if self.activation_checkpointing else "off"
        offload = "on" if self.cpu_offload else "off"
        cdt = "bf16" if self.precision == "bf16-mixed" else "fp32"
        strategy = self.sharding
        if self.layout == "fsdp2":
            strategy = f"FSDP2 reshard_after_forward={self.sharding == 'FULL_SHARD'}"
        frozen = ", ".join(self.freeze) or "nothing"
        if self.adapter is not None:
            frozen = f"everything but LoRA r{self.adapter['rank']}/alpha{self.adapter['alpha']:g} adapters" + (
                f" and {', '.join(self.adapter['trainable'])}" if self.adapter.get("trainable") else ""
            )
        lines = [
            f"Qwen3-TTS memory plan: {self.model}: {self.total_parameters / 1e6:,.1f}M parameters, "
            f"{self.trainable_parameters / 1e6:,.1f}M trainable (frozen: {frozen})",
            f"{self.gpus} GPU(s) x {self.gpu_memory / GiB:.1f} GiB, {strategy}, {self.precision}, "
            f"activation checkpointing {ckpt}, cpu offload {offload}, "
            f"{self.micro_batch_frames} talker positions per micro-batch, {self.units} FSDP units",
            "                                                    GiB per GPU",
            f"  parameters (fp32 master)                         {g(self.parameters)}",
            f"  gradients (fp32)                                 {g(self.gradients)}",
            f"  optimizer states (AdamW, fp32)                   {g(self.optimizer_states)}",
            f"  gathered units + unsharded grads (at the peak)   {g(self.gathered)}",
            f"    for reference: root unit, full {cdt} (all step) {g(self.root_unit)}",
            f"    for reference: largest unit, full {cdt}         {g(self.largest_gathered_unit)}"
            f"  ({self.largest_unit_name})",
            f"  activations + logits (at the peak)               {g(self.activations)}",
            f"  CUDA context + allocator (constant)              {g(self.overhead)}",
            f"  total at the peak                                {g(self.total)}",
            f"    (peak: {self.peak_phase})",
            f"  GPU memory                                       {g(self.gpu_memory)}",
            f"  headroom                                         {g(self.headroom)}",
        ]
        if self.samples:
            lines += [
                "  samples (SpeakerSamplesCallback, rank 0, after validation):",
                f"    model states + generation copy {g(self.samples_model)} + KV cache {g(self.samples_cache)}"
                f" + CUDA, then the speech tokenizer {g(self.speech_tokenizer)} instead of the copy",
                f"    total at the sampling peak                     {g(self.samples_total)}",
            ]
        if self.cpu_offload:
            lines.append(
                f"  host memory for offloaded states: {self.host_memory / GiB:.2f} GiB per GPU, "
                f"{self.host_memory * self.gpus / GiB:.2f} GiB for {self.gpus} GPU(s) on one node (pinned)"
            )
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def plan_memory(
    model: str | os.PathLike | Mapping[str, Any],
    *,
    gpus: int,
    gpu_memory_gb: float,
    sharding: Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"] = "FULL_SHARD",
    precision: Literal["bf16-mixed", "32-true"] = "bf16-mixed",
    activation_checkpointing: bool | Sequence[str] = True,
    cpu_offload: bool = False,
    freeze: Sequence[str] = DEFAULT_FREEZE,
    micro_batch_frames: int = 2000,
    auto_wrap_policy: Sequence[str] | None = None,
    samples: bool = False,
    sample_rows: int = 4,
    sample_frames: int = 600,
    advise: bool = True,
    adapter: Any = None,
    layout: Literal["fsdp1", "fsdp2"] = "fsdp1",
    groups: Sequence[Sequence[str]] | None = None,
) -> MemoryPlan:
    """Plan per-GPU memory for one training step.

    Args:
        model: ``"1.7b"``, ``"0.6b"``, a released hub id, a pretrained directory, or a config dict.
        gpus: data-parallel GPUs (FSDP world size). gpu_memory_gb: memory of one GPU, in GiB.
        activation_checkpointing: True (both decoder-layer classes, the strategy's default), False,
            or a list of class import paths as in ``activation_checkpointing_policy``.
        freeze: parameter-name patterns, as `Qwen3TTSModule`'s ``freeze``.
        micro_batch_frames: padded talker positions per micro-batch (``max_frames_per_batch``).
        auto_wrap_policy: class import paths; default the strategy's ``DEFAULT_WRAP``.
        samples: plan `SpeakerSamplesCallback` too: on rank 0, after validation, a copy of the model
            in the compute dtype plus the KV cache of ``sample_rows`` rows (speakers x texts) of up
            to ``sample_frames`` frames (``max_new_tokens``), then the speech tokenizer (counted when
            ``model`` is a local directory) while it decodes.
        adapter: LoRA settings (`tts_lightning.model.lora.LoRASettings` or its dict) as
            `Qwen3TTSModule`'s ``adapter``: only the adapters and ``adapter.trainable`` train.
        layout: ``"fsdp1"`` (`Qwen3TTSFSDPStrategy`, flat parameters per unit) or ``"fsdp2"``
            (`Qwen3TTSFSDP2Strategy`, ``fully_shard``): every parameter sharded on dim 0 and padded
            to a multiple of ``gpus`` rows, frozen parameters with no gradient at all, no switch to
            NO_SHARD on one GPU; ``sharding`` FULL_SHARD is ``reshard_after_forward: true``,
            SHARD_GRAD_OP is ``false``, NO_SHARD is not planned. ``auto_wrap_policy`` then names the
            layer classes (the strategy's ``layer_classes``) and ``groups`` its module-name groups.
    """
    from tts_lightning.model.lora import LoRASettings, checkpoint_key, is_adapter_key

    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "fsdp2" and sharding == "NO_SHARD":
        raise ValueError("NO_SHARD is not planned for FSDP2 (fully_shard always shards; plan FULL_SHARD)")
    if gpus < 1 or micro_batch_frames < 1 or gpu_memory_gb <= 0:
        raise ValueError("gpus, micro_batch_frames and gpu_memory_gb must be positive")
    name, config = resolve_config(model)
    settings = LoRASettings.coerce(adapter)
    fsdp2 = layout == "fsdp2"
    shape = model_shape(config, auto_wrap_policy, settings, layout=layout, groups=groups)
    freeze = list(freeze)
    b = 2 if precision == "bf16-mixed" else 4
    notes: list[str] = []
    effective = sharding
    if gpus == 1 and sharding != "NO_SHARD" and not fsdp2:
        effective = "NO_SHARD"
        notes.append(f"{sharding} on one GPU runs as NO_SHARD (FSDP switches when the world size is 1)")
    shards = gpus if effective != "NO_SHARD" else 1

    def is_trainable(p: str) -> bool:
        if settings is None:
            return not matches(p, freeze)
        return (is_adapter_key(p) or matches(checkpoint_key(p), settings.trainable)) and not matches(
            checkpoint_key(p), freeze
        )

    def trainable(unit: Unit) -> int:
        return sum(n for p, n in unit.params if is_trainable(p))

    total_params = shape.numel
    train_params = sum(trainable(u) for u in shape.units)
    grad_numel = sum(u.numel for u in shape.units if trainable(u))
    mixed = [u.name or "root" for u in shape.units if 0 < trainable(u) < u.numel]
    if mixed and not fsdp2:
        frozen_in_mixed = sum(u.numel - trainable(u) for u in shape.units if 0 < trainable(u) < u.numel)
        notes.append(
            f"{frozen_in_mixed / 1e6:.1f}M frozen parameters share a unit with trainable ones "
            f"({', '.join(mixed[:3])}{'...' if len(mixed) > 3 else ''}): FSDP keeps their gradient"
        )
    params_b = 4 * math.ceil(total_params / shards)
    if settings is not None:  # the frozen base in its storage dtype (bf16 under bf16-mixed), the rest fp32
        frozen_bytes = 2 if settings.frozen_dtype(precision) == torch.bfloat16 else 4
        params_b = 4 * math.ceil(train_params / shards) + frozen_bytes * math.ceil(
            (total_params - train_params) / shards
        )
        notes.append(
            f"LoRA: frozen base stored in {'bf16' if frozen_bytes == 2 else 'fp32'}, "
            f"adapters{' and extras' if settings.trainable else ''} in fp32 with AdamW state"
        )
    grads_b = 4 * math.ceil(grad_numel / shards)
    optim_b = 8 * math.ceil(train_params / shards)
    if fsdp2:  # per parameter: its dim 0 padded to a multiple of the world size; gradients only where it trains
        frozen_storage = 2 if settings is not None and settings.frozen_dtype(precision) == torch.bfloat16 else 4
        params_b = grads_b = optim_b = 0
        for unit in shape.units:
            for (p, numel), rows in zip(unit.params, unit.rows, strict=True):
                local = math.ceil(rows / shards) * (numel // rows) if rows else 0
                if is_trainable(p):
                    params_b, grads_b, optim_b = params_b + 4 * local, grads_b + 4 * local, optim_b + 8 * local
                else:
                    params_b += frozen_storage * local
        notes.append(
            "FSDP2: each parameter sharded on dim 0 (padded per parameter); frozen parameters keep no "
            "gradient; buffers are never cast"
        )
    host = 0
    if cpu_offload:
        host = params_b + grads_b + optim_b
        params_b = grads_b = optim_b = 0

    root = shape.units[0]
    others = [u for u in shape.units[1:] if not fsdp2 or u.gathered_in_training]
    largest = max(others, key=lambda u: u.numel, default=None)
    layer_units = [u for u in others if u.kind != "embedding"] or list(others)
    largest_layer = max(layer_units, key=lambda u: u.numel, default=None)

    def unit_transient(unit: Unit | None, copies: int) -> int:
        # `copies` gathered copies in the compute dtype + its unsharded gradient (compute dtype
        # and an fp32 copy for the reduce-scatter) when it has trainable parameters.
        if unit is None:
            return 0
        if fsdp2:  # gradients of the trainable parameters only
            return unit.numel * copies * b + trainable(unit) * (b + 4)
        return unit.numel * (copies * b + ((b + 4) if trainable(unit) else 0))

    root_b = root.numel * b
    root_grad = root.numel * b if trainable(root) else 0
    if fsdp2:
        root_grad = trainable(root) * b
    if effective == "NO_SHARD" and precision == "32-true" and not cpu_offload:
        # Parameters are used in place and gradients accumulate into the persistent fp32 ones.
        phase_a_units = phase_b_units = 0
        gathered_root = 0
    elif effective == "SHARD_GRAD_OP":
        gathered_root = root_b + root_grad
        all_gathered = sum(u.numel for u in others) * b
        phase_a_units = all_gathered + unit_transient(largest_layer, 0)
        phase_b_units = all_gathered + unit_transient(largest, 0)
    else:  # FULL_SHARD, or NO_SHARD with bf16 copies of each unit's parameters
        gathered_root = root_b + root_grad
        phase_a_units = unit_transient(largest_layer, 2)  # the running unit + one prefetched
        phase_b_units = unit_transient(largest, 1)

    ckpt_t, ckpt_cp = _checkpointed(activation_checkpointing)
    acts, logits = _activation_bytes(shape.dims, micro_batch_frames, b, ckpt_t, ckpt_cp)
    phase_a = gathered_root + phase_a_units + acts + logits
    phase_b = gathered_root + phase_b_units + logits
    if phase_a >= phase_b:
        phase, gathered, activations = (
            "start of backward, activations alive",
            gathered_root + phase_a_units,
            acts + logits,
        )
    else:
        phase, gathered, activations = "end of backward, largest unit", gathered_root + phase_b_units, logits
    persistent = params_b + grads_b + optim_b
    total = persistent + CUDA_OVERHEAD_BYTES + max(phase_a, phase_b)
    samples_model = samples_cache = tokenizer = samples_total = 0
    if samples:
        d = shape.dims
        samples_model = total_params * b
        prefill = 64  # role, tags, speaker and a sentence of text
        samples_cache = sample_rows * (prefill + sample_frames) * d["layers"] * 2 * d["kv"] * b
        tokenizer = speech_tokenizer_bytes(model)
        if not tokenizer:
            notes.append("the speech tokenizer is not counted (plan a local pretrained directory to count it)")
        samples_total = persistent + CUDA_OVERHEAD_BYTES + max(samples_model + samples_cache, tokenizer)
        notes.append(
            f"samples: rank 0 gathers the fp32 weights to host memory first "
            f"({4 * total_params / GiB:.1f} GiB of RAM, released before generation)"
        )
        total = max(total, samples_total)
    gpu_memory = int(gpu_memory_gb * GiB)
    plan = MemoryPlan(
        model=name,
        gpus=gpus,
        gpu_memory=gpu_memory,
        sharding=sharding,
        precision=precision,
        activation_checkpointing=bool(ckpt_t or ckpt_cp),
        cpu_offload=cpu_offload,
        freeze=freeze,
        micro_batch_frames=micro_batch_frames,
        total_parameters=total_params,
        trainable_parameters=train_params,
        parameters=params_b,
        gradients=grads_b,
        optimizer_states=optim_b,
        largest_gathered_unit=(largest.numel * b) if largest else 0,
        root_unit=root_b,
        gathered=gathered,
        activations=activations,
        overhead=CUDA_OVERHEAD_BYTES,
        total=total,
        fits=total <= gpu_memory,
        headroom=gpu_memory - total,
        host_memory=host,
        peak_phase=phase,
        units=len(shape.units),
        largest_unit_name=largest.name if largest else "",
        notes=notes,
        samples=samples,
        samples_model=samples_model,
        samples_cache=samples_cache,
        speech_tokenizer=tokenizer,
        samples_total=samples_total,
        adapter=None if settings is None else settings.to_dict(),
        layout=layout,
    )
    if ckpt_t != ckpt_cp:
        notes.append("activation checkpointing covers only the " + ("talker" if ckpt_t else "code predictor"))
    if advise and not plan.fits:
        plan.advice = _advice(
            config,
            plan,
            dict(
                gpus=gpus,
                gpu_memory_gb=gpu_memory_gb,
                sharding=sharding,
                precision=precision,
                activation_checkpointing=activation_checkpointing,
                cpu_offload=cpu_offload,
                freeze=freeze,
                micro_batch_frames=micro_batch_frames,
                auto_wrap_policy=auto_wrap_policy,
                samples=samples,
                sample_rows=sample_rows,
                sample_frames=sample_frames,
                adapter=None if settings is None else settings.to_dict(),
                layout=layout,
                groups=groups,
            ),
        )
    return plan


def speech_tokenizer_bytes(model: str | os.PathLike | Mapping[str, Any]) -> int:
    """fp32 bytes of a local pretrained directory's speech tokenizer (read from the safetensors
    header, no weights loaded); 0 when ``model`` is not a local directory."""
    if isinstance(model, Mapping):
        return 0
    path = Path(str(model)).expanduser() / "speech_tokenizer" / "model.safetensors"
    if not path.is_file():
        return 0
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return 4 * sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def _advice(config: dict, plan: MemoryPlan, settings: dict) -> list[str]:
    """Options that make it fit, cheapest first, applied cumulatively until it fits."""

    advice: list[str] = []
    current = plan

    def attempt(text: str, **change) -> bool:
        nonlocal current
        trial = plan_memory(config, **{**settings, **change}, advise=False)
        advice.append(
            f"{text}: {current.total / GiB:.1f} -> {trial.total / GiB:.1f} GiB per GPU"
            + (" (fits)" if trial.fits else "")
        )
        settings.update(change)
        current = trial
        return trial.fits

    if _checkpointed(settings["activation_checkpointing"]) != (True, True) and attempt(
        "turn on activation checkpointing (strategy activation_checkpointing_policy: both "
        "decoder-layer classes; costs ~30% more compute)",
        activation_checkpointing=True,
    ):
        return advice
    if (
        settings["sharding"] != "FULL_SHARD"
        and settings["gpus"] > 1
        and attempt(
            "use reshard_after_forward: true"
            if settings.get("layout") == "fsdp2"
            else "use sharding_strategy FULL_SHARD",
            sharding="FULL_SHARD",
        )
    ):
        return advice
    if (
        settings.get("adapter") is None
        and not matches(TEXT_EMBEDDING + ".weight", settings["freeze"])
        and attempt(
            f"freeze {TEXT_EMBEDDING} (model.freeze; 311M parameters in the released models, rarely "
            "worth training for a new voice)",
            freeze=settings["freeze"] + [TEXT_EMBEDDING],
        )
    ):
        return advice
    # More GPUs: an alternative, not applied to the steps that follow.
    for n in (2, 4, 8, 16, 32, 64, 128):
        if n > settings["gpus"]:
            trial = plan_memory(config, **{**settings, "gpus": n, "sharding": "FULL_SHARD"}, advise=False)
            if trial.fits:
                advice.append(f"or use {n} GPUs with FULL_SHARD: {trial.total / GiB:.1f} GiB per GPU (fits)")
                break
    if not settings["cpu_offload"] and attempt(
        "turn on cpu_offload (parameters, gradients and AdamW state in host RAM; much slower steps)", cpu_offload=True
    ):
        return advice
    lo, hi = 0, settings["micro_batch_frames"]
    while hi - lo > 1:  # the largest micro-batch that fits
        mid = (lo + hi) // 2
        if plan_memory(config, **{**settings, "micro_batch_frames": mid}, advise=False).fits:
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
