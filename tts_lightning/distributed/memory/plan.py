"""The plan: per-GPU bytes of a run's phases (`plan_memory`, `MemoryPlan`): start (the model built and
sharded), the training step (the peak), a checkpoint save, a resume, and the samples callback; and
the speech tokenizer's size. The advice that makes a plan fit is in `advice.py`."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tts_lightning.distributed.memory.activations import _activation_bytes, _checkpointed
from tts_lightning.distributed.memory.advice import advise
from tts_lightning.distributed.memory.optimizer_bytes import STEP_BYTES, option_states, value_bytes
from tts_lightning.distributed.memory.presets import resolve_config
from tts_lightning.distributed.memory.settings import PRECISIONS, SHARDINGS, PlanSettings
from tts_lightning.distributed.memory.shapes import ModelShape, Unit, model_shape
from tts_lightning.model.optimizers import quantized_moments
from tts_lightning.model.parameters import matches

__all__ = [
    "CUDA_OVERHEAD_BYTES",
    "GiB",
    "PRECISIONS",
    "SHARDINGS",
    "MemoryPlan",
    "PlanSettings",
    "plan_memory",
    "asr_model_bytes",
    "speech_tokenizer_bytes",
]

GiB = 2**30
CUDA_OVERHEAD_BYTES = 1 * GiB  # CUDA context + library workspaces + allocator fragmentation: a constant


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
    asr_model: int = 0  # rank 0: the samples' Whisper model on the GPU while it transcribes (bf16)
    samples_total: int = 0  # rank 0 at the sampling peak (training activations are gone then)
    samples_at_start: bool = False  # the samples' baseline / held-out round at fit start counts in `startup`
    adapter: dict | None = None  # LoRA settings (`tts_lightning.model.lora.LoRASettings`), if any
    layout: str = "fsdp1"  # "fsdp1" (`Qwen3TTSFSDPStrategy`) or "fsdp2" (`Qwen3TTSFSDP2Strategy`)
    # The other phases, per GPU, with the CUDA constant like `total`:
    startup: int = 0  # the model built and sharded (the largest unit whole while it is), or the samples' first round
    checkpoint_save: int = 0  # a sharded checkpoint being written (views of the shards: nothing gathered)
    checkpoint_host: int = 0  # host memory per GPU process then: the writer's copies of the shards
    resume: int = 0  # a checkpoint read back, before the first step (FSDP2: with zero gradients)
    optimizer: str = "adamw"  # `Qwen3TTSModule`'s ``optimizer`` (`optimizer_bytes.py`)
    optimizer_step: int = 0  # torchao's step: model states + its fp32 copies of the largest piece
    planned: tuple[Any, PlanSettings] | None = field(default=None, repr=False, compare=False)  # (model, settings)
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
        weights = "bf16" if self.optimizer.startswith("bf16_sr") else "fp32"
        master = "(fp32 master)" if weights == "fp32" else "(bf16)       "
        if self.adapter is not None:  # the frozen base in its storage dtype, the adapters fp32
            master = "(frozen base + adapters)"
        moments = {"adamw": "AdamW, fp32", "adamw8bit": "AdamW 8-bit", "adamw4bit": "AdamW 4-bit"}.get(
            self.optimizer, "bf16 AdamW" if self.optimizer == "bf16_sr" else "AdamW 8-bit"
        )
        lines = [
            f"Qwen3-TTS memory plan: {self.model}: {self.total_parameters / 1e6:,.1f}M parameters, "
            f"{self.trainable_parameters / 1e6:,.1f}M trainable (frozen: {frozen})",
            f"{self.gpus} GPU(s) x {self.gpu_memory / GiB:.1f} GiB, {strategy}, {self.precision}, "
            f"activation checkpointing {ckpt}, cpu offload {offload}, "
            f"{self.micro_batch_frames} talker positions per micro-batch, {self.units} FSDP units",
            "                                                    GiB per GPU",
            f"  parameters {master:<38}{g(self.parameters)}",
            f"  gradients ({weights})                                 {g(self.gradients)}",
            f"  optimizer states ({moments})" + " " * (30 - len(moments)) + f"{g(self.optimizer_states)}",
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
                f"    states + generation copy {g(self.samples_model)} + KV cache {g(self.samples_cache)}"
                f" + CUDA, then the speech tokenizer {g(self.speech_tokenizer)} instead of the copy"
                + (f", then the ASR model {g(self.asr_model).strip()}" if self.asr_model else ""),
                f"    total at the sampling peak                     {g(self.samples_total)}",
            ]
        lines.append(
            f"  other phases: start {g(self.startup).strip()}"
            + (" (with the samples' first round)" if self.samples_at_start else "")
            + f", checkpoint save {g(self.checkpoint_save).strip()} "
            f"(+ {self.checkpoint_host / GiB:.2f} GiB host per process), resume {g(self.resume).strip()}"
        )
        if self.optimizer != "adamw":
            lines.append(
                f"  model.optimizer {self.optimizer}: the optimizer step (fp32 copies of the largest piece) "
                f"{g(self.optimizer_step).strip()}"
            )
        if self.cpu_offload:
            lines.append(
                f"  host memory for offloaded states: {self.host_memory / GiB:.2f} GiB per GPU, "
                f"{self.host_memory * self.gpus / GiB:.2f} GiB for {self.gpus} GPU(s) on one node (pinned)"
            )
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def plan_memory(model: str | os.PathLike | Mapping[str, Any], *, advise: bool = True, **settings: Any) -> MemoryPlan:
    """Plan per-GPU memory for a run's phases (the training step's peak in ``total``).

    ``model``: ``"1.7b"``, ``"0.6b"``, a released hub id, a pretrained directory, or a config dict;
    ``settings``: `PlanSettings`' fields. ``advise``: when it does not fit, say what would."""
    checked = PlanSettings(**settings)
    name, config = resolve_config(model)
    tokenizer, asr = (speech_tokenizer_bytes(model), asr_model_bytes(checked.sample_asr)) if checked.samples else (0, 0)
    plan = _plan(name, config, checked, tokenizer=tokenizer, asr=asr)
    plan.planned = (model, checked)
    if advise and not plan.fits:
        plan.advice = _advise(config, plan, checked)
    return plan


def _advise(config: dict, plan: MemoryPlan, settings: PlanSettings) -> list[str]:
    return advise(plan, settings, lambda trial: _plan(plan.model, config, trial, tokenizer=0))


@dataclass
class _States:
    """Persistent bytes per GPU: parameters, gradients, AdamW state (in host memory under cpu_offload)."""

    parameters: int
    gradients: int
    optimizer: int
    host: int
    trainable: int
    step_piece: int = 0  # values of the largest trained local piece (torchao's step copies it in fp32)


def _plan(name: str, config: dict, settings: PlanSettings, *, tokenizer: int, asr: int = 0) -> MemoryPlan:
    from tts_lightning.model.lora import LoRASettings

    adapter = LoRASettings.coerce(settings.adapter)
    shape = model_shape(
        config,
        settings.auto_wrap_policy,
        adapter,
        layout=settings.layout,
        groups=settings.groups,
        text_embedding_blocks=settings.text_embedding_blocks,
    )
    notes: list[str] = []
    effective = settings.sharding
    if settings.gpus == 1 and settings.sharding != "NO_SHARD" and not settings.fsdp2:
        effective = "NO_SHARD"
        notes.append(f"{settings.sharding} on one GPU runs as NO_SHARD (FSDP switches when the world size is 1)")
    is_trainable, trainable = _trainability(settings, adapter)
    states = _model_states(shape, settings, adapter, effective, (is_trainable, trainable), notes)
    step = _step_transients(shape, settings, effective, trainable)
    persistent = states.parameters + states.gradients + states.optimizer
    total = persistent + CUDA_OVERHEAD_BYTES + max(step["a"], step["b"])
    optimizer_step = 0
    if settings.optimizer != "adamw" and not settings.cpu_offload:
        optimizer_step = persistent + CUDA_OVERHEAD_BYTES + STEP_BYTES[settings.optimizer] * states.step_piece
        if optimizer_step > total:
            total, step["phase"] = optimizer_step, "the optimizer step, fp32 copies of the largest piece"
    samples_model = samples_cache = samples_total = 0
    if settings.samples:
        samples_model, samples_cache = _sampling(shape, settings)
        if not tokenizer:
            notes.append("the speech tokenizer is not counted (plan a local pretrained directory to count it)")
        if settings.sample_asr not in (None, "pocketsphinx") and not asr:
            asr_name = settings.sample_asr
            notes.append(f"the samples' ASR model {asr_name} is not counted (give a local folder to count it)")
        # The samples run in validation, which Lightning starts by releasing the gradients.
        at_validation = persistent - (0 if settings.validation_holds_gradients else states.gradients)
        # One at a time on the GPU: the copy with its KV cache, then the speech tokenizer, then the ASR model.
        samples_total = at_validation + CUDA_OVERHEAD_BYTES + max(samples_model + samples_cache, tokenizer, asr)
        if effective == "NO_SHARD" and not settings.fsdp2 and not settings.cpu_offload:
            notes.append("samples: rank 0 copies the parameters it holds on the GPU (NO_SHARD): no host copy")
        else:
            notes.append(
                f"samples: rank 0 gathers the weights to host memory first "
                f"({value_bytes(settings.optimizer) * shape.numel / GiB:.1f} GiB of RAM, released as the copy is made)"
            )
        if samples_total > total:
            total, step["phase"] = samples_total, "rank 0's samples after validation, below"
    startup, save, host_save, resume = _checkpoint_phases(shape, settings, states)
    if settings.full_checkpoints and not settings.cpu_offload:
        # Lightning gathers a full checkpoint into rank 0's host memory; FSDP1's resume reads the
        # whole optimizer state into every process (FSDP2's maps the file on rank 0 and scatters).
        shards = 1 if effective == "NO_SHARD" else settings.gpus
        whole, optimizer = (states.parameters + states.optimizer) * shards, states.optimizer * shards
        resumed = (
            ""
            if settings.fsdp2
            else f"; a resume reads its optimizer state whole into every process ({optimizer / GiB:.1f} GiB each)"
        )
        notes.append(
            f"state_dict_type full (not in the phases here): a save gathers the parameters and optimizer state into "
            f"rank 0's host memory ({whole / GiB:.1f} GiB){resumed}; sharded checkpoints do neither"
        )
    if adapter is not None and not settings.cpu_offload:
        # LoRA checkpoints hold the trainable tensors only (fp32): the frozen base is never copied.
        shards = 1 if effective == "NO_SHARD" else settings.gpus
        host_save = 4 * math.ceil(states.trainable / shards) + states.optimizer
    if settings.samples and settings.samples_at_start:
        # The baseline round runs once the model is sharded (its build transient freed) and before
        # the first step (no gradients or optimizer state yet); a resumed run skips it.
        baseline_round = states.parameters + CUDA_OVERHEAD_BYTES + max(samples_model + samples_cache, tokenizer, asr)
        startup = max(startup, baseline_round)
    gpu_memory = int(settings.gpu_memory_gb * GiB)
    largest = step["largest"]
    plan = MemoryPlan(
        model=name,
        gpus=settings.gpus,
        gpu_memory=gpu_memory,
        sharding=settings.sharding,
        precision=settings.precision,
        activation_checkpointing=bool(any(_checkpointed(settings.activation_checkpointing))),
        cpu_offload=settings.cpu_offload,
        freeze=list(settings.freeze),
        micro_batch_frames=settings.micro_batch_frames,
        total_parameters=shape.numel,
        trainable_parameters=states.trainable,
        parameters=states.parameters,
        gradients=states.gradients,
        optimizer_states=states.optimizer,
        largest_gathered_unit=(largest.numel * settings.compute_bytes) if largest else 0,
        root_unit=shape.units[0].numel * settings.compute_bytes,
        gathered=step["gathered"],
        activations=step["activations"],
        overhead=CUDA_OVERHEAD_BYTES,
        total=total,
        fits=total <= gpu_memory,
        headroom=gpu_memory - total,
        host_memory=states.host,
        peak_phase=step["phase"],
        units=len(shape.units),
        largest_unit_name=largest.name if largest else "",
        notes=notes,
        samples=settings.samples,
        samples_model=samples_model,
        samples_cache=samples_cache,
        speech_tokenizer=tokenizer,
        asr_model=asr,
        samples_total=samples_total,
        samples_at_start=settings.samples and settings.samples_at_start,
        adapter=None if adapter is None else adapter.to_dict(),
        layout=settings.layout,
        startup=startup,
        checkpoint_save=save,
        checkpoint_host=host_save,
        resume=resume,
        optimizer=settings.optimizer,
        optimizer_step=optimizer_step,
    )
    ckpt_t, ckpt_cp = _checkpointed(settings.activation_checkpointing)
    if ckpt_t != ckpt_cp:
        notes.append("activation checkpointing covers only the " + ("talker" if ckpt_t else "code predictor"))
    return plan


def _trainability(settings: PlanSettings, adapter: Any) -> tuple[Callable[[str], bool], Callable[[Unit], int]]:
    """``is_trainable(name)`` of a parameter, and ``trainable(unit)``: how many of a unit's parameters train."""
    from tts_lightning.model.lora import checkpoint_key, is_adapter_key

    def is_trainable(p: str) -> bool:
        if adapter is None:
            return not matches(p, settings.freeze)
        return (is_adapter_key(p) or matches(checkpoint_key(p), adapter.trainable)) and not matches(
            checkpoint_key(p), settings.freeze
        )

    def trainable(unit: Unit) -> int:
        return sum(n for p, n in unit.params if is_trainable(p))

    return is_trainable, trainable


def _model_states(
    shape: ModelShape, settings: PlanSettings, adapter: Any, effective: str, trainability: tuple, notes: list[str]
) -> _States:
    is_trainable, trainable = trainability
    shards = settings.gpus if effective != "NO_SHARD" else 1
    total_params = shape.numel
    train_params = sum(trainable(u) for u in shape.units)
    grad_numel = sum(u.numel for u in shape.units if trainable(u))
    mixed = [u.name or "root" for u in shape.units if 0 < trainable(u) < u.numel]
    if mixed and not settings.fsdp2:
        frozen_in_mixed = sum(u.numel - trainable(u) for u in shape.units if 0 < trainable(u) < u.numel)
        notes.append(
            f"{frozen_in_mixed / 1e6:.1f}M frozen parameters share a unit with trainable ones "
            f"({', '.join(mixed[:3])}{'...' if len(mixed) > 3 else ''}): FSDP keeps their gradient"
        )
    frozen_bytes = 4
    if adapter is not None:  # the frozen base in its storage dtype (bf16 under bf16-mixed), the rest fp32
        frozen_bytes = 2 if adapter.frozen_dtype(settings.precision) == torch.bfloat16 else 4
    params_b = 4 * math.ceil(total_params / shards)
    if adapter is not None:
        params_b = 4 * math.ceil(train_params / shards) + frozen_bytes * math.ceil(
            (total_params - train_params) / shards
        )
        notes.append(
            f"LoRA: frozen base stored in {'bf16' if frozen_bytes == 2 else 'fp32'}, "
            f"adapters{' and extras' if adapter.trainable else ''} in fp32 with AdamW state"
        )
    grads_b = 4 * math.ceil(grad_numel / shards)
    optim_b = 8 * math.ceil(train_params / shards)
    if settings.fsdp2:  # per parameter: its dim 0 padded to a multiple of the world size; gradients where it trains
        params_b = grads_b = optim_b = 0
        for unit in shape.units:
            for (p, numel), rows in zip(unit.params, unit.rows, strict=True):
                local = math.ceil(rows / shards) * (numel // rows) if rows else 0
                if is_trainable(p):
                    params_b, grads_b, optim_b = params_b + 4 * local, grads_b + 4 * local, optim_b + 8 * local
                else:
                    params_b += frozen_bytes * local
        notes.append(
            "FSDP2: each parameter sharded on dim 0 (padded per parameter); frozen parameters keep no "
            "gradient; buffers are never cast"
        )
    piece = 0
    if settings.optimizer != "adamw":
        params_b, grads_b, optim_b, piece = option_states(
            shape, settings.optimizer, shards, settings.fsdp2, is_trainable, grad_numel, frozen_bytes
        )
    if settings.cpu_offload:
        return _States(0, 0, 0, params_b + grads_b + optim_b, train_params, piece)
    return _States(params_b, grads_b, optim_b, 0, train_params, piece)


def _step_transients(
    shape: ModelShape, settings: PlanSettings, effective: str, trainable: Callable[[Unit], int]
) -> dict[str, Any]:
    """The training step's transients at its peak: gathered units and unsharded gradients, and
    activations; the larger of (a) the start of backward and (b) the end of backward."""
    b, fsdp2 = settings.compute_bytes, settings.fsdp2
    root = shape.units[0]
    others = [u for u in shape.units[1:] if not fsdp2 or u.gathered_in_training]

    def grad_numel(unit: Unit) -> int:  # FSDP2: trainable parameters only; FSDP1: the whole flat one
        return trainable(unit) if fsdp2 else (unit.numel if trainable(unit) else 0)

    # The codec embeddings: gathered, with their gradient, from early in the backward (the code
    # predictor's input) to its end (`Unit.held_in_backward`); only those that train get a gradient.
    held_units = [u for u in others if u.held_in_backward and trainable(u)]
    others = [u for u in others if u not in held_units]
    held = sum(u.numel * b + grad_numel(u) * b for u in held_units)
    held_reduce = max((grad_numel(u) * 4 for u in held_units), default=0)  # its fp32 copy, at the end
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
    root_grad = (trainable(root) if fsdp2 else (root.numel if trainable(root) else 0)) * b
    if effective == "NO_SHARD" and settings.precision == "32-true" and not settings.cpu_offload:
        # Parameters are used in place and gradients accumulate into the persistent fp32 ones.
        phase_a_units = phase_b_units = gathered_root = held = held_reduce = 0
    elif effective == "SHARD_GRAD_OP":
        gathered_root = root_b + root_grad
        all_gathered = sum(u.numel for u in others) * b
        phase_a_units = all_gathered + unit_transient(largest_layer, 0)
        phase_b_units = all_gathered + unit_transient(largest, 0)
    else:  # FULL_SHARD, or NO_SHARD with bf16 copies of each unit's parameters
        gathered_root = root_b + root_grad
        phase_a_units = unit_transient(largest_layer, 2)  # the running unit + one prefetched
        phase_b_units = unit_transient(largest, 1)
    phase_a_units += held
    phase_b_units = held + max(phase_b_units, held_reduce)
    ckpt_t, ckpt_cp = _checkpointed(settings.activation_checkpointing)
    acts, logits = _activation_bytes(shape.dims, settings.micro_batch_frames, b, ckpt_t, ckpt_cp)
    a, b_phase = gathered_root + phase_a_units + acts + logits, gathered_root + phase_b_units + logits
    if a >= b_phase:
        phase, gathered, activations = (
            "start of backward, activations alive",
            gathered_root + phase_a_units,
            acts + logits,
        )
    else:
        phase, gathered, activations = "end of backward, largest unit", gathered_root + phase_b_units, logits
    return {"a": a, "b": b_phase, "phase": phase, "gathered": gathered, "activations": activations, "largest": largest}


def _sampling(shape: ModelShape, settings: PlanSettings) -> tuple[int, int]:
    """Rank 0 while sampling: the generation copy of the model and the KV cache of the sampled rows."""
    d, b = shape.dims, settings.compute_bytes
    prefill = 64  # role, tags, speaker and a sentence of text
    cache = settings.sample_rows * (prefill + settings.sample_frames) * d["layers"] * 2 * d["kv"] * b
    return shape.numel * b, cache


def _checkpoint_phases(shape: ModelShape, settings: PlanSettings, states: _States) -> tuple[int, int, int, int]:
    """Start, checkpoint save (device, and host per process), resume; each with the CUDA constant.

    - start: the parameters' shards, plus the unit being built whole in fp32 and flattened (FSDP1:
      two copies of the largest unit) or one parameter read whole and scattered (FSDP2: two copies
      of the largest parameter);
    - save: the parameters and optimizer state as they are (sharded checkpoints hand the writer
      views of the shards: `tts_lightning.distributed.lean_state`, FSDP2's DTensors), without
      gradients where the checkpoint is written after validation (Lightning releases them before
      it: ``on_validation_model_zero_grad``; measured: benchmarks/phase_memory.py), with them where
      it is written while they are held (``save_at_train_steps``, ``validation_holds_gradients``);
      on a GPU the writer copies each
      tensor to host memory and keeps the copies until the rank's file is written (a torch
      behaviour): the parameters and AdamW state of the rank, in host memory;
    - resume: the model built first (the start, with its transient), then the parameters and the
      AdamW state read back into their shards: the larger of the two, as the start's transient is
      freed before the checkpoint is read (measured: benchmarks/phase_memory.py). FSDP1 reads the
      optimizer state without gradients; FSDP2's reader (torch's `get_optimizer_state_dict`) first
      creates the state with one zero-learning-rate step on zero gradients, so the gradients are
      there while it does (tests/distributed/test_memory_fsdp2.py pins that torch behaviour); the
      quantized optimizers' per-rank state is read without it (`rank_local_state`)."""
    if settings.fsdp2:
        whole = 2 * 4 * max((n for u in shape.units for _, n in u.params), default=0)
    else:
        whole = 2 * 4 * max((u.numel for u in shape.units[1:]), default=0)
    startup = states.parameters + whole + CUDA_OVERHEAD_BYTES
    gradients_held = settings.save_at_train_steps or settings.validation_holds_gradients
    held = states.parameters + states.optimizer + (states.gradients if gradients_held else 0)
    save = held + CUDA_OVERHEAD_BYTES
    host = 0 if settings.cpu_offload else states.parameters + states.optimizer
    zero_step = settings.fsdp2 and quantized_moments(settings.optimizer) is None  # torch's reader steps once
    read_into = states.parameters + states.optimizer + (states.gradients if zero_step else 0)
    resume = max(startup, read_into + CUDA_OVERHEAD_BYTES)
    return startup, save, host, resume


def asr_model_bytes(asr: str | None) -> int:
    """bf16 bytes of the samples' Whisper model when ``asr`` is a local folder (on a GPU
    `make_recognizer` loads it in bf16: `whisper_dtype`), read from its safetensors headers; 0 for
    none, pocketsphinx (CPU) or a hub name (not read here: the plan says it is not counted)."""
    folder = Path(asr).expanduser() if asr and asr != "pocketsphinx" else None
    if folder is None or not folder.is_dir():
        return 0
    from safetensors import safe_open

    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            total += 2 * sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return total


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
