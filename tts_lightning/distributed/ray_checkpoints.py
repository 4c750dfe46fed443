"""Ray Train checkpoints of a ``ray-fit`` run: `RayCheckpointReport` saves a Lightning checkpoint on
every rank and reports each rank's own files to Ray, which merges them into
``<storage_path>/<name>/checkpoint_stepNNNNNN/checkpoint.ckpt``; `checkpoint_file` and
`latest_checkpoint` find the Lightning checkpoint inside a reported one. The launcher is
`tts_lightning.distributed.ray`."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import ray
import ray.train
from lightning.pytorch import Callback, Trainer
from ray.train import Checkpoint

CHECKPOINT_NAME = "checkpoint.ckpt"
_SHARD_FILE = re.compile(r"__(\d+)_\d+\.distcp$")


class RayCheckpointReport(Callback):
    """Save a Lightning checkpoint and report it to Ray Train, from every rank.

    Saves every ``every_n_steps`` optimizer steps (0: at each training epoch end) and once more
    when training ends. Ray's stock `RayTrainReportCallback` only reports at epoch ends, and with
    a sharded FSDP state dict it loses shards on a multi-node cluster: Lightning broadcasts rank
    0's path, so every rank writes its ``__<rank>_0.distcp`` into a folder named after rank 0's
    temporary folder, while each rank reports (uploads) its own, empty, folder. Here each rank
    saves into the same node-local path, then reports a folder holding only the files it wrote
    (its shard; rank 0 also ``.metadata`` and ``meta.pt``, or the whole file of a full
    checkpoint), and Ray merges them into ``checkpoint_stepNNNNNN/checkpoint.ckpt``.
    """

    def __init__(self, every_n_steps: int = 0) -> None:
        if every_n_steps < 0:
            raise ValueError(f"every_n_steps must be >= 0, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self._last_step: int | None = None
        ctx = ray.train.get_context()
        run = re.sub(r"[^A-Za-z0-9_.-]", "_", ctx.get_experiment_name())
        self.local_root = Path(tempfile.gettempdir(), f"tts-lightning-ray-{run}")

    def on_train_start(self, trainer: Trainer, pl_module) -> None:
        self._last_step = trainer.global_step  # a resumed run does not save its start again

    def on_train_batch_end(self, trainer: Trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._last_step or step == 0:
            return
        periodic = self.every_n_steps and step % self.every_n_steps == 0
        if periodic or (trainer.max_steps > 0 and step >= trainer.max_steps):  # the last step: mid-epoch state
            self.report(trainer)

    def on_train_epoch_end(self, trainer: Trainer, pl_module) -> None:
        if not self.every_n_steps and trainer.global_step != self._last_step:
            self.report(trainer)

    def on_train_end(self, trainer: Trainer, pl_module) -> None:
        if trainer.global_step != self._last_step:
            self.report(trainer)
        if trainer.local_rank == 0:
            shutil.rmtree(self.local_root, ignore_errors=True)

    def on_exception(self, trainer: Trainer, pl_module, exception: BaseException) -> None:
        if trainer.local_rank == 0:
            shutil.rmtree(self.local_root, ignore_errors=True)

    def report(self, trainer: Trainer) -> None:
        step, rank = trainer.global_step, trainer.global_rank
        tag = f"step{step:06d}"
        saved = self.local_root / tag / CHECKPOINT_NAME  # the same path on every rank
        trainer.save_checkpoint(saved, weights_only=False)
        trainer.strategy.barrier()  # every rank's files are written

        mine = self.local_root / f"{tag}-rank{rank}"
        shutil.rmtree(mine, ignore_errors=True)
        own = self._own_files(saved, rank)
        for src in own:
            dst = mine / CHECKPOINT_NAME / src.relative_to(saved) if saved.is_dir() else mine / CHECKPOINT_NAME
            dst.parent.mkdir(parents=True, exist_ok=True)
            _link_or_copy(src, dst)

        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1}
        metrics.update(step=step, epoch=trainer.current_epoch)
        ray.train.report(
            metrics,
            checkpoint=Checkpoint.from_directory(str(mine)) if own else None,
            checkpoint_dir_name=f"checkpoint_{tag}",
        )
        if _ray_train_v2():
            # Ray registers a checkpoint only once it has collected every rank's report, which it
            # polls for; a worker dying before that would lose it. Wait until it is committed.
            if trainer.global_rank == 0:
                ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
        trainer.strategy.barrier()  # every rank has uploaded before the local files go
        shutil.rmtree(mine, ignore_errors=True)
        if trainer.local_rank == 0:
            shutil.rmtree(saved.parent, ignore_errors=True)
        self._last_step = step

    @staticmethod
    def _own_files(saved: Path, rank: int) -> list[Path]:
        """The files of a checkpoint this rank wrote."""
        if saved.is_file():
            return [saved] if rank == 0 else []
        if not saved.is_dir():
            return []
        own = []
        for path in sorted(p for p in saved.rglob("*") if p.is_file()):
            shard = _SHARD_FILE.search(path.name)
            if (shard is not None and int(shard.group(1)) == rank) or (shard is None and rank == 0):
                own.append(path)
        return own


def _ray_train_v2() -> bool:
    return bool(getattr(ray.train, "is_v2_enabled", lambda: False)())


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def checkpoint_file(checkpoint_dir: str | os.PathLike) -> Path:
    """The Lightning checkpoint (a file, or a sharded folder) inside a reported Ray checkpoint."""
    return Path(checkpoint_dir) / CHECKPOINT_NAME


def latest_checkpoint(run_dir: str) -> str | None:
    """The newest checkpoint Ray committed for a run folder (``<storage_path>/<name>``), as the
    path (or URI) of its Lightning checkpoint; None when there is none."""
    try:
        checkpoint = ray.train.Result.from_path(run_dir).checkpoint
    except (RuntimeError, OSError, ValueError):
        return None
    if checkpoint is None:
        return None
    path = str(checkpoint_file(checkpoint.path))
    scheme = run_dir.split("://", 1)[0] if "://" in run_dir else None
    return f"{scheme}://{path}" if scheme else path
