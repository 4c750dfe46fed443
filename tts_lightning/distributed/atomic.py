"""Checkpoints written atomically by every rank of a multi-process strategy. Shared by the FSDP
strategies."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import ParallelStrategy


class AtomicCheckpoints(ParallelStrategy):
    """Mixin placed before a Lightning parallel strategy (``class S(AtomicCheckpoints, FSDPStrategy)``):
    its ``save_checkpoint`` writes through the strategy's own one beside the destination, then renames."""

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """Write beside the destination, then rename, so an interrupted save never leaves a
        half-written checkpoint where `--ckpt_path last` would find it. Each node's local rank 0
        renames what its node wrote (node-local storage keeps every node's shards), and a failed
        write on any rank removes the partial everywhere and raises on every rank."""
        final = Path(self.broadcast(str(filepath)))
        partial = final.with_name(f".{final.name}.partial")
        old = final.with_name(f".{final.name}.old")
        if self.local_rank == 0:
            _remove(partial)
        self.barrier("checkpoint_prepare")
        error: BaseException | None = None
        try:
            super().save_checkpoint(checkpoint, partial, storage_options)
        except Exception as exc:  # every rank must learn of it, or the others wait forever
            error = exc
        if not self.reduce_boolean_decision(error is None, all=True):
            if self.local_rank == 0:
                _remove(partial)
            self.barrier("checkpoint_failed")
            raise CheckpointWriteError(final, error) from error
        self.barrier("checkpoint_written")
        if self.is_global_zero:
            _rename(partial, final, old)
        self.barrier("checkpoint_renamed")
        if self.local_rank == 0 and not self.is_global_zero and partial.exists():
            _rename(partial, final, old)  # node-local storage: this node's own copy
        self.barrier("checkpoint_renamed_on_nodes")


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the previous one at that path is intact."""

    def __init__(self, path: Path, error: BaseException | None) -> None:
        usage = shutil.disk_usage(_existing_parent(path))
        full = usage.free < max(64 * 2**20, usage.total // 100)
        cause = "the disk is full" if full else "the write failed"
        reason = f"{type(error).__name__}: {error}" if error is not None else "on another rank"
        super().__init__(
            f"could not write checkpoint {path}: {cause} ({usage.free / 2**30:.2f} GiB free on "
            f"that disk; {reason}). The partial write was removed; an earlier checkpoint at that path is intact."
        )


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _rename(partial: Path, final: Path, old: Path) -> None:
    _remove(old)
    if final.exists():
        os.replace(final, old)  # a folder cannot be replaced in one step
    os.replace(partial, final)
    _remove(old)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)  # another node may remove a shared folder too
    elif path.exists() or path.is_symlink():
        path.unlink()
