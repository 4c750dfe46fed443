"""Read a Lightning training checkpoint of `Qwen3TTSModule`, full (one file) or sharded (a folder
written by FSDP with any number of ranks), reading only what is asked for.

- **Safe to load**: only tensors and plain data are unpickled (``torch.load(weights_only=True)``),
  so a checkpoint whose pickle would run code is refused before any code runs. ``trust=True``
  (``--trust-checkpoint``) opts in to a full unpickle, for a legacy file you made yourself.
- **Sharded**: the model's tensors are read from the ``torch.distributed.checkpoint`` files by key;
  the optimizer state in the same files is never read. Both layouts are read: FSDP1's (module state
  under ``model.``) and FSDP2's (`Qwen3TTSFSDP2Strategy`, under ``state_dict.``). Hyper-parameters
  and the step come from Lightning's ``meta.pt``.
- **Full**: the file is memory-mapped, so its optimizer state is never read into memory either.
"""

from __future__ import annotations

import os
import pickle
import warnings
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tts_lightning.errors import ConfigError, UserError
from tts_lightning.model.row_blocks import block_groups, join_blocks, official_layout

MODEL_PREFIX = "model."  # Lightning's FSDP1 sharded layout: {"model": module state, "optimizer_0": ...}
FSDP2_PREFIX = "state_dict."  # FSDP2's (`Qwen3TTSFSDP2Strategy`): {"state_dict": module state, ...}
GIVE_THE_FOLDER = "give that folder"  # what to do instead, in the message: no other hint after it
TRUST_HINT = (
    "If you made this checkpoint yourself and trust it, pass --trust-checkpoint "
    "(trust=True in Python) to load it anyway."
)


class CheckpointError(UserError, ValueError):
    """A checkpoint is missing, unreadable, unsafe or not one of this project's."""


# The strategy that writes each sharded layout (their module states are keyed apart, so neither
# strategy resumes the other's; `CheckpointReader` and `export` read both).
SHARDED_BY = {MODEL_PREFIX: "FSDP1 (Qwen3TTSFSDPStrategy)", FSDP2_PREFIX: "FSDP2 (Qwen3TTSFSDP2Strategy)"}


def sharded_prefix(metadata_keys: Iterable[str]) -> str:
    """The prefix of the module's keys in a sharded checkpoint whose metadata holds ``metadata_keys``."""
    return FSDP2_PREFIX if any(k.startswith(FSDP2_PREFIX) for k in metadata_keys) else MODEL_PREFIX


def refuse_other_strategy(path: str | os.PathLike, written_prefix: str, run_prefix: str) -> None:
    """One line where a run would resume a sharded checkpoint the other strategy wrote (a traceback
    of a missing key on every rank before)."""
    if written_prefix != run_prefix:
        raise ConfigError(
            f"ckpt_path {path} is a sharded checkpoint of {SHARDED_BY[written_prefix]}, this run uses "
            f"{SHARDED_BY[run_prefix]}: use the strategy it was written with (the config it was "
            "trained with); `tts-lightning export` reads either"
        )


@dataclass
class TrainingCheckpoint:
    path: Path
    state_dict: dict[str, torch.Tensor]  # the module's keys: "model.<hf key>", "speaker_embeddings", ...
    hyper_parameters: dict[str, Any]
    global_step: int

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The plain `Qwen3TTSForConditionalGeneration` keys, as its safetensors file names them."""
        return {k[len("model.") :]: v for k, v in self.state_dict.items() if k.startswith("model.")}


def _torch_load(path: Path | str, *, trust: bool, mmap: bool = False) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=not trust, mmap=mmap)
    except pickle.UnpicklingError as exc:
        if trust:
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"refusing to load {path}: it holds pickled objects other than tensors and plain data, "
            f"which can run code when loaded ({first}). {TRUST_HINT}"
        ) from exc


class CheckpointReader:
    """The tensors of a training checkpoint's module state, read on demand.

    ``tensor_keys()`` lists the module's keys (``model.talker...``, ``speaker_embeddings``);
    ``read(keys)`` returns just those, in their stored dtype, on the CPU.
    """

    def __init__(self, path: str | os.PathLike, *, trust: bool = False) -> None:
        self.path = path = Path(path)
        if not path.exists():
            raise CheckpointError(f"checkpoint {path} does not exist")
        if path.is_file() and (path.parent / ".metadata").is_file():  # meta.pt, __0_0.distcp
            raise CheckpointError(f"{path} is one file of the sharded checkpoint {path.parent}: {GIVE_THE_FOLDER}")
        if path.is_file() and not zipfile.is_zipfile(path):  # what torch.save writes
            raise CheckpointError(
                f"{path} is not a checkpoint (not a whole file written by torch.save: another format, or cut short)"
            )
        self.sharded = path.is_dir()
        self._prefix = MODEL_PREFIX  # of the module's keys in a sharded checkpoint (`SHARDED_BY`)
        try:
            if self.sharded:
                if not (path / ".metadata").is_file():
                    held = sorted(p.name for p in path.iterdir() if p.suffix == ".ckpt" and not p.name.startswith("."))
                    inside = f"; it holds the checkpoints {', '.join(held)}" if held else ""  # a run's folder
                    raise CheckpointError(
                        f"{path} is a folder but not a sharded checkpoint (no .metadata file{inside})"
                    )
                from torch.distributed.checkpoint import FileSystemReader
                from torch.distributed.checkpoint.metadata import TensorStorageMetadata

                metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
                # FSDP2 nests the module state (whose own keys start with "model.") under "state_dict."
                self._prefix = sharded_prefix(metadata)
                self._sizes = {
                    fqn[len(self._prefix) :]: (m.size, m.properties.dtype)
                    for fqn, m in metadata.items()
                    if fqn.startswith(self._prefix) and isinstance(m, TensorStorageMetadata)
                }
                meta_file = path / "meta.pt"
                raw = _torch_load(meta_file, trust=trust) if meta_file.is_file() else {}
                self._full: dict[str, Any] = {}
            else:
                raw = _torch_load(path, trust=trust, mmap=True)
                if not isinstance(raw, dict) or "state_dict" not in raw:
                    raise CheckpointError(f"{path} is not a Lightning checkpoint (no state_dict)")
                self._full = {k: v for k, v in raw["state_dict"].items() if isinstance(v, torch.Tensor)}
                self._sizes = {k: (v.shape, v.dtype) for k, v in self._full.items()}
        except CheckpointError:
            raise
        except Exception as exc:  # truncated, corrupt or foreign files all surface here
            raise CheckpointError(f"cannot read checkpoint {path}: {type(exc).__name__}: {exc}") from exc
        if not isinstance(raw, dict):
            raise CheckpointError(f"{path} is not a Lightning checkpoint")
        if not any(k.startswith("model.talker.") for k in self._sizes):
            raise CheckpointError(f"{path} holds no Qwen3-TTS weights (no model.talker.* keys)")
        self.hyper_parameters: dict[str, Any] = dict(raw.get("hyper_parameters") or {})
        self.datamodule_hyper_parameters: dict[str, Any] = dict(raw.get("datamodule_hyper_parameters") or {})
        self.global_step = int(raw.get("global_step", 0))
        # The text embedding's row blocks (`tts_lightning.model.row_blocks`) read as one official
        # tensor: export and loading see the layout of the pretrained weights.
        self._stored = dict(self._sizes)  # as written: the blocks' keys
        self._blocks = block_groups(self._sizes)
        layout = official_layout(self._sizes)
        for whole, blocks in self._blocks.items():
            shapes = [self._sizes[k][0] for k in blocks]
            rows = sum(int(shape[0]) for shape in shapes)
            self._sizes[whole] = (torch.Size([rows, *shapes[0][1:]]), self._sizes[blocks[0]][1])
        self._sizes = {k: self._sizes[k] for k in layout}

    @property
    def sharded_prefix(self) -> str | None:
        """The layout of a sharded checkpoint (`SHARDED_BY`); None for a checkpoint file."""
        return self._prefix if self.sharded else None

    def tensor_keys(self) -> list[str]:
        return list(self._sizes)

    def dtype(self, key: str) -> torch.dtype:
        return self._sizes[key][1]

    def numel(self, key: str) -> int:
        return int(torch.Size(self._sizes[key][0]).numel())

    def read(self, keys: Iterable[str], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The tensors of ``keys``, in their stored dtype or cast to ``dtype`` as they are read (a
        sharded checkpoint's pieces are copied straight into tensors of that dtype: no full-size
        copy in the stored dtype)."""
        keys = list(keys)
        unknown = [k for k in keys if k not in self._sizes]
        if unknown:
            raise CheckpointError(f"{self.path} has no tensor(s) {unknown[:5]}")
        joined = {k: self._blocks[k] for k in keys if k in self._blocks}
        if joined:  # each read as its blocks, then joined
            values = self._read([k for k in keys if k not in joined] + [b for v in joined.values() for b in v], dtype)
            for whole, blocks in joined.items():
                values[whole] = join_blocks(values, blocks)
                for block in blocks:
                    del values[block]
            return {k: values[k] for k in keys}
        return self._read(keys, dtype)

    def _read(self, keys: list[str], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        if not self.sharded:
            return {k: self._full[k] if dtype is None else self._full[k].to(dtype) for k in keys}
        from torch.distributed.checkpoint import FileSystemReader, load

        sizes = self._stored
        target = {self._prefix + k: torch.empty(sizes[k][0], dtype=dtype or sizes[k][1]) for k in keys}
        try:
            with warnings.catch_warnings():  # no_dist is meant: one process reads
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                load(target, storage_reader=FileSystemReader(str(self.path)), no_dist=True)
        except Exception as exc:
            raise CheckpointError(f"cannot read checkpoint {self.path}: {type(exc).__name__}: {exc}") from exc
        return {k: target[self._prefix + k] for k in keys}


def groups_of_bytes(keys: Iterable[str], nbytes: Callable[[str], int], limit: int) -> list[list[str]]:
    """``keys`` in order, in consecutive groups of at most ``limit`` bytes (``nbytes(key)``; a tensor
    larger than that is a group of its own): a checkpoint read or a safetensors shard at a time."""
    groups: list[list[str]] = []
    size = 0
    for key in keys:
        if not groups or size + nbytes(key) > limit:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes(key)
    return groups


def load_training_checkpoint(
    path: str | os.PathLike, *, trust: bool = False, keys: Sequence[str] | None = None
) -> TrainingCheckpoint:
    """The module state (all tensors, or ``keys``), hyper-parameters and step of a checkpoint."""
    reader = CheckpointReader(path, trust=trust)
    state = reader.read(reader.tensor_keys() if keys is None else keys)
    return TrainingCheckpoint(
        path=reader.path, state_dict=state, hyper_parameters=reader.hyper_parameters, global_step=reader.global_step
    )
