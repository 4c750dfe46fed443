"""Checkpoints written atomically by every rank of a multi-process strategy, readable on every node
(`tts_lightning.distributed.node_local`), superseded ones removed on every node. Shared by the FSDP
strategies."""

from __future__ import annotations

import io
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.strategies import ParallelStrategy

from tts_lightning.errors import ConfigError

META = "meta.pt"  # Lightning's file of a sharded checkpoint's loops, callbacks and hyper-parameters
INDEX = ".metadata"  # torch.distributed.checkpoint's index of the shards


_RESUME_HINT = (
    "A run of several nodes resumes from storage every node sees, or from sharded checkpoints "
    "(trainer.strategy.init_args.state_dict_type: sharded), which every node keeps its part of"
)


class AtomicCheckpoints(ParallelStrategy):
    """Mixin placed before a Lightning parallel strategy (``class S(AtomicCheckpoints, FSDPStrategy)``):
    its ``save_checkpoint`` writes beside the destination, then renames.

    A strategy that writes sharded checkpoints says so with `_writes_sharded` and names the module
    state's key (`_sharded_state_key`: Lightning's FSDP1 layout has ``model``, FSDP2's
    ``state_dict``); they are written here, as Lightning writes them, with the node-local planner
    and writer of `tts_lightning.distributed.node_local`."""

    _sharded_state_key = "model"
    _node_of_rank: list[int] | None = None
    # Whether this rank found a checkpoint to resume from where `tts_lightning.cli` resolved one on
    # its own storage (`--ckpt_path last`, a requeued SLURM job); None where nothing was resolved.
    resolved_resume: bool | None = None
    num_nodes: int  # set by the Trainer on Lightning's parallel strategies

    def _writes_sharded(self) -> bool:
        return False

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """Write beside the destination, then rename, so an interrupted save never leaves a
        half-written checkpoint where `--ckpt_path last` would find it. Each node's local rank 0
        renames what its node wrote (node-local storage keeps every node's shards), and a failed
        write on any rank removes the partial everywhere and raises on every rank."""
        final = Path(self.broadcast(str(filepath)))
        partial = final.with_name(f".{final.name}.partial")
        old = final.with_name(f".{final.name}.old")
        if not self._writes_sharded():
            from tts_lightning.distributed.rank_local_state import prepare_full

            prepare_full(self, checkpoint)
        if self.local_rank == 0:
            _remove(partial)
        self.barrier("checkpoint_prepare")
        if self._writes_sharded():
            indexes: dict[str, Any] = {}
            self._agreed_step(final, partial, lambda: indexes.update(self._write_sharded(checkpoint, partial)))
            self._agreed_step(final, partial, lambda: self._hand_out(partial, indexes))
        else:
            self._agreed_step(
                final,
                partial,
                lambda: super(AtomicCheckpoints, self).save_checkpoint(checkpoint, partial, storage_options),
            )
        if self.is_global_zero:
            _rename(partial, final, old)
        self.barrier("checkpoint_renamed")
        if self.local_rank == 0 and not self.is_global_zero and partial.exists():
            _rename(partial, final, old)  # node-local storage: this node's own copy
        self.barrier("checkpoint_renamed_on_nodes")

    def _agreed_step(self, final: Path, partial: Path, step: Callable[[], Any]) -> None:
        """Run ``step`` on every rank; if it failed anywhere, remove the partial write and raise on
        every rank (or the others would wait forever)."""
        error: BaseException | None = None
        try:
            step()
        except Exception as exc:
            error = exc
        if not self.reduce_boolean_decision(error is None, all=True):
            if self.local_rank == 0:
                _remove(partial)
            self.barrier("checkpoint_failed")
            raise CheckpointWriteError(final, error) from error

    def _write_sharded(self, checkpoint: dict[str, Any], path: Path) -> dict[str, Any]:
        """Lightning's sharded layout (the module state, ``optimizer_N``, ``meta.pt`` by rank 0),
        every node writing one copy of what all ranks hold. Returns, on global rank 0, what the
        other nodes need to read their part: their indexes and ``meta.pt``."""
        from torch.distributed.checkpoint import save

        from tts_lightning.distributed.node_local import NodeLocalSavePlanner, NodeLocalWriter

        nodes = self._nodes()
        path.mkdir(parents=True, exist_ok=True)
        state = {self._sharded_state_key: checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        writer = NodeLocalWriter(path, nodes)
        save(state, storage_writer=writer, planner=NodeLocalSavePlanner(nodes))
        if not self.is_global_zero:
            return {}
        meta = io.BytesIO()
        # Rank 0's tensors (ModelCheckpoint's scores...) in host memory: read back on another rank's
        # GPU they would land on cuda:0 (a CUDA context there per rank) and meet that rank's own
        # tensors on another device. On CPU nothing moves: checked by benchmarks/gpu_check.py.
        torch.save(move_data_to_device(checkpoint, "cpu"), meta)
        (path / META).write_bytes(meta.getvalue())
        return {"meta": meta.getvalue(), "indexes": {n: pickle.dumps(m) for n, m in writer.node_indexes.items()}}

    def _hand_out(self, path: Path, written: dict[str, Any]) -> None:
        """Every node's local rank 0 that does not see rank 0's index (node-local storage) writes its
        node's index and ``meta.pt`` into its folder."""
        written = self.broadcast(written if self.is_global_zero else {})
        if self.local_rank != 0 or (path / INDEX).is_file() or self.node_rank not in written["indexes"]:
            return
        path.mkdir(parents=True, exist_ok=True)
        (path / META).write_bytes(written["meta"])
        (path / INDEX).write_bytes(written["indexes"][self.node_rank])

    def _nodes(self) -> list[int]:
        """The node of every global rank (the same on every rank; one collective, once)."""
        if self._node_of_rank is None:
            rows = torch.zeros(self.world_size, dtype=torch.long, device=self.root_device)  # NCCL: never CPU
            rows[self.global_rank] = self.node_rank
            self._node_of_rank = [int(n) for n in self.reduce(rows, reduce_op="sum").cpu()]
        return self._node_of_rank

    def setup(self, trainer) -> None:
        from tts_lightning.distributed.rank_local_state import prepare_full_saves

        self._check_full_checkpoint_storage(trainer)
        self._check_every_rank_resumes()
        self._remove_cut_short_saves(trainer)
        super().setup(trainer)
        prepare_full_saves(self)  # after the optimizers exist

    def _check_every_rank_resumes(self) -> None:
        """``--ckpt_path last`` (or a requeued SLURM job) is resolved by every rank on its own storage
        (`tts_lightning.cli`, which says here whether it found one: `resolved_resume`): on node-local
        disks a node without the run's checkpoints (a job requeued onto other machines) started from
        step 0 while the others resumed, and the resume's first collective hung. Refused on every
        rank at once instead."""
        if self.world_size <= 1 or self.resolved_resume is None:
            return
        if self.reduce_boolean_decision(self.resolved_resume, all=False) and not self.reduce_boolean_decision(
            self.resolved_resume, all=True
        ):
            finds = "finds one" if self.resolved_resume else "finds none"
            raise ConfigError(
                f"cannot resume: some nodes find a checkpoint of this run to resume from and others do not "
                f"(node {self.node_rank} {finds}; node-local storage without the run's checkpoints?). {_RESUME_HINT}"
            )

    def _remove_cut_short_saves(self, trainer) -> None:
        """Half-written checkpoints a killed save left (``.<name>.partial``, never resumed from) go
        when a fit starts: a save removes only its own name's, and the next top-k or requeue
        checkpoint has another name (a model-size leftover per kill otherwise). Each node's local
        rank 0, on its own storage; not in `validate`, which may run beside a fit that is saving."""
        if self.local_rank != 0 or trainer.state.fn != "fit":
            return
        dirpath = getattr(trainer.checkpoint_callback, "dirpath", None)
        for folder in {Path(trainer.default_root_dir), *([Path(dirpath)] if dirpath else [])}:
            remove_half_written(folder)

    def _check_full_checkpoint_storage(self, trainer) -> None:
        """A full checkpoint is one file that global rank 0 writes: a run of several nodes can resume
        from it only where every node sees that file. Refused at start, on every rank, when the
        checkpoint folder is node-local (a probe file rank 0 writes is not seen on some node)."""
        dirpath = getattr(trainer.checkpoint_callback, "dirpath", None)
        if self.num_nodes <= 1 or self._writes_sharded() or not dirpath:
            return
        probe = Path(dirpath) / f".probe-{self.broadcast(os.urandom(8).hex())}"
        if self.is_global_zero:
            probe.parent.mkdir(parents=True, exist_ok=True)
            probe.touch()
        self.barrier("probe_written")
        seen = probe.exists()
        shared = self.reduce_boolean_decision(seen, all=True)
        if self.is_global_zero:
            probe.unlink()
        if not shared:
            raise ValueError(
                f"full checkpoints (trainer.strategy.init_args.state_dict_type: full) are written by rank 0 "
                f"alone, and node {self.node_rank} {'sees' if seen else 'does not see'} its folder {dirpath}: "
                "put trainer.default_root_dir on storage every node sees, or use state_dict_type: sharded "
                "(every node keeps its part)"
            )

    def check_on_every_node(self, checkpoint_path) -> Path:
        """The checkpoint to resume from, once every rank sees it. A multi-node run keeps its
        checkpoints on each node's own disk if the path is node-local: sharded ones are readable
        there (each node has its part and an index of it), a full one exists on the node of rank
        0 only. Refused on every rank at once, naming the setting, instead of a crash or a hang."""
        path = Path(self.broadcast(str(checkpoint_path)))
        readable = path.is_file() or (path / META).is_file()
        if not self.reduce_boolean_decision(readable, all=True):
            where = "here" if not readable else "on another node"
            raise FileNotFoundError(
                f"cannot resume: checkpoint {path} is missing {where} (node {self.node_rank}). {_RESUME_HINT}"
            )
        if self.num_nodes > 1 and (path / META).is_file():
            # Node-local folders: a save stopped after one node's rename and before another's leaves
            # the nodes with checkpoints of different steps at one path, which would resume together.
            steps: list[Any] = [None] * self.world_size
            torch.distributed.all_gather_object(steps, (self.node_rank, _saved_step(path)))
            if len({step for _, step in steps}) > 1:
                nodes = ", ".join(f"node {node}: {step}" for node, step in sorted(set(steps)))
                raise ConfigError(
                    f"cannot resume: checkpoint {path} differs between the nodes ({nodes}), a save stopped "
                    "between the nodes' renames; resume with --ckpt_path naming a checkpoint of one step on "
                    "every node (the run's top-k checkpoints, or copy one node's folder to the others)"
                )
        return path

    def remove_checkpoint(self, filepath) -> None:
        """`ModelCheckpoint` removes a superseded checkpoint through this on every rank; Lightning
        removes it on global rank 0 only, so node-local storage kept every other node's copy until
        its disk was full. Each node's local rank 0 removes its node's copy (on shared storage the
        nodes remove the same one: a folder or file already gone is fine)."""
        if self.local_rank == 0:
            _remove(Path(filepath))


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


def _saved_step(folder: Path) -> str:
    """``step N`` of a sharded checkpoint, from its small ``meta.pt`` (loops, callbacks, settings;
    read as the strategies' load reads it by default), or why it cannot be read: said on every
    rank, never raised on some."""
    try:
        meta = torch.load(folder / META, map_location="cpu", weights_only=True)
        return f"step {int(meta['global_step'])}"
    except Exception as exc:  # truncated, corrupt, not Lightning's
        return f"unreadable meta.pt ({type(exc).__name__})"


def remove_half_written(folder: str | os.PathLike, prefix: str = "") -> None:
    """Remove the half-written checkpoints (``.<name>.partial``, `AtomicCheckpoints.save_checkpoint`)
    a killed save left in ``folder``, of names starting with ``prefix``: never resumed from, and a
    later save has another name."""
    folder = Path(folder)
    for leftover in folder.glob(f".{prefix}*.ckpt.partial") if folder.is_dir() else ():
        _remove(leftover)


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _rename(partial: Path, final: Path, old: Path) -> None:
    """``partial`` becomes ``final``. A file replaces a file in one step; a folder cannot, so the old
    one is set aside as ``old`` first. A set-aside without its ``final`` is the last complete
    checkpoint of a save stopped between the renames (`tts_lightning.resume_path` resumes from it):
    kept until the new one is in place."""
    if final.exists() and (final.is_dir() or partial.is_dir()):
        _remove(old)
        os.replace(final, old)
    os.replace(partial, final)
    _remove(old)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)  # another node may remove a shared folder too
    else:
        path.unlink(missing_ok=True)
