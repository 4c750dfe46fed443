"""`PlanSettings`: what a memory plan depends on besides the model, checked once."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tts_lightning.distributed.memory.shapes import LAYOUTS
from tts_lightning.model.parameters import DEFAULT_FREEZE
from tts_lightning.model.row_blocks import DEFAULT_TEXT_EMBEDDING_BLOCKS

SHARDINGS = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
PRECISIONS = ("bf16-mixed", "32-true")


@dataclass(frozen=True)
class PlanSettings:
    """The run a plan is for (`plan_memory` takes these as keyword arguments).

    Args:
        gpus: data-parallel GPUs (FSDP world size). gpu_memory_gb: memory of one GPU, in GiB.
        activation_checkpointing: True (both decoder-layer classes, the strategy's default), False,
            or a list of class import paths as in ``activation_checkpointing_policy``.
        freeze: parameter-name patterns, as `Qwen3TTSModule`'s ``freeze``.
        micro_batch_frames: padded talker positions per micro-batch (``max_frames_per_batch``).
        auto_wrap_policy: class import paths; default the strategy's ``DEFAULT_WRAP``.
        samples: plan `SpeakerSamplesCallback` too: on rank 0, after validation, a copy of the model
            in the compute dtype plus the KV cache of ``sample_rows`` rows (speakers x texts) of up
            to ``sample_frames`` frames (``max_new_tokens``), then the speech tokenizer (counted when
            the model is a local directory) while it decodes.
        samples_at_start: with ``samples``, the callback also samples once at the start of a run
            from step 0 (its ``baseline`` or ``held_out`` round), before any optimizer state exists.
        sample_asr: the callback's ``asr``: a local Whisper folder is counted on the GPU while it
            transcribes, after the speech tokenizer.
        adapter: LoRA settings (`tts_lightning.model.lora.LoRASettings` or its dict) as
            `Qwen3TTSModule`'s ``adapter``: only the adapters and ``adapter.trainable`` train.
        layout: ``"fsdp1"`` (`Qwen3TTSFSDPStrategy`, flat parameters per unit) or ``"fsdp2"``
            (`Qwen3TTSFSDP2Strategy`, ``fully_shard``): every parameter sharded on dim 0 and padded
            to a multiple of ``gpus`` rows, frozen parameters with no gradient at all, no switch to
            NO_SHARD on one GPU; ``sharding`` FULL_SHARD is ``reshard_after_forward: true``,
            SHARD_GRAD_OP is ``false``, NO_SHARD is not planned. ``auto_wrap_policy`` then names the
            layer classes (the strategy's ``layer_classes``) and ``groups`` its module-name groups.
        optimizer: `Qwen3TTSModule`'s ``optimizer`` (bytes per value in `optimizer_bytes.py`).
        text_embedding_blocks: `Qwen3TTSModule`'s row blocks of the text embedding (FSDP units).
        save_at_train_steps: checkpoints are written while the last step's gradients are held: at
            training steps' ends (`ModelCheckpoint`'s ``every_n_train_steps`` or
            ``train_time_interval``; `ray-fit`'s reports every N steps and at ``max_steps``, which
            `plan_from_config` reads given ``ray_checkpoint_every_n_steps``) or at an epoch's end
            with no validation before it; otherwise after validation, which Lightning starts by
            releasing them.
        full_checkpoints: the strategy's ``state_dict_type`` is ``full`` (one file): its save and
            resume are not planned, only said (a note); the configs' ``sharded`` ones are.
        validation_holds_gradients: validation can start in the middle of gradient accumulation
            (Lightning releases the gradients before validation only at a step boundary): then
            validation, the samples and the checkpoint after it hold them.
    """

    gpus: int
    gpu_memory_gb: float
    sharding: Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"] = "FULL_SHARD"
    precision: Literal["bf16-mixed", "32-true"] = "bf16-mixed"
    activation_checkpointing: bool | Sequence[str] = True
    cpu_offload: bool = False
    freeze: Sequence[str] = tuple(DEFAULT_FREEZE)
    micro_batch_frames: int = 2000
    auto_wrap_policy: Sequence[str] | None = None
    samples: bool = False
    sample_rows: int = 4
    sample_frames: int = 600
    samples_at_start: bool = True
    sample_asr: str | None = None
    adapter: Any = None
    layout: Literal["fsdp1", "fsdp2"] = "fsdp1"
    groups: Sequence[Sequence[str]] | None = None
    optimizer: str = "adamw"
    text_embedding_blocks: int = DEFAULT_TEXT_EMBEDDING_BLOCKS
    save_at_train_steps: bool = False
    validation_holds_gradients: bool = False
    full_checkpoints: bool = False

    def __post_init__(self) -> None:
        from tts_lightning.model.optimizers import OPTIMIZERS

        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.optimizer.startswith("bf16_sr") and self.precision != "bf16-mixed":
            raise ValueError(f"optimizer {self.optimizer} keeps bf16 weights: plan it with precision bf16-mixed")
        if self.sharding not in SHARDINGS:
            raise ValueError(f"sharding must be one of {SHARDINGS}, got {self.sharding!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.layout == "fsdp2" and self.sharding == "NO_SHARD":
            raise ValueError("NO_SHARD is not planned for FSDP2 (fully_shard always shards; plan FULL_SHARD)")
        if self.gpus < 1 or self.micro_batch_frames < 1 or self.gpu_memory_gb <= 0:
            raise ValueError("gpus, micro_batch_frames and gpu_memory_gb must be positive")

    @property
    def fsdp2(self) -> bool:
        return self.layout == "fsdp2"

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of the compute dtype (gathered parameters, activations)."""
        return 2 if self.precision == "bf16-mixed" else 4
