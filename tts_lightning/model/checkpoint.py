"""Read a Lightning training checkpoint of `Qwen3TTSModule`, full (one file) or sharded (a folder
written by FSDP with any number of ranks), into one CPU state dict."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable or not one of this project's."""


@dataclass
class TrainingCheckpoint:
    path: Path
    state_dict: dict[str, torch.Tensor]  # the module's keys: "model.<hf key>", "speaker_embeddings", ...
    hyper_parameters: dict[str, Any]
    global_step: int

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The plain `Qwen3TTSForConditionalGeneration` keys, as its safetensors file names them."""
        return {k[len("model."):]: v for k, v in self.state_dict.items() if k.startswith("model.")}


def load_training_checkpoint(path: str | os.PathLike) -> TrainingCheckpoint:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        if path.is_dir():
            from lightning.fabric.utilities.load import _load_distributed_checkpoint
            from lightning.pytorch.utilities.consolidate_checkpoint import _format_checkpoint

            if not (path / ".metadata").is_file():
                raise CheckpointError(f"{path} is a folder but not a sharded checkpoint (no .metadata file)")
            raw = _format_checkpoint(_load_distributed_checkpoint(path))
        else:
            raw = torch.load(path, map_location="cpu", weights_only=False)
    except CheckpointError:
        raise
    except Exception as exc:  # truncated, corrupt or foreign files all surface here
        raise CheckpointError(f"cannot read checkpoint {path}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(raw, dict) or "state_dict" not in raw:
        raise CheckpointError(f"{path} is not a Lightning checkpoint (no state_dict)")
    state = raw["state_dict"]
    if not any(k.startswith("model.talker.") for k in state):
        raise CheckpointError(f"{path} holds no Qwen3-TTS weights (no model.talker.* keys)")
    return TrainingCheckpoint(
        path=path,
        state_dict={k: v for k, v in state.items() if isinstance(v, torch.Tensor)},
        hyper_parameters=dict(raw.get("hyper_parameters") or {}),
        global_step=int(raw.get("global_step", 0)),
    )
