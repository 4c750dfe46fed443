"""Callbacks the Ray tests put into the workers' trainers (through an extra ``--config``).
The workers import this module: the tests add this folder to PYTHONPATH."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from lightning.pytorch import Callback


class CrashOnce(Callback):
    """Kill this worker process (``os._exit``, no cleanup, as a crash would) on ``rank`` just before
    optimizer step ``step + 1`` runs, once: the marker file makes the restarted worker carry on."""

    def __init__(self, step: int, marker: str, rank: int = 1) -> None:
        self.step, self.marker, self.rank = step, marker, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank and not os.path.exists(self.marker):
            Path(self.marker).write_text(f"crashed rank {self.rank} at step {self.step}\n")
            print(f"[CrashOnce] rank {self.rank} exits at global_step {self.step}", flush=True)
            os._exit(1)


class RecordSteps(Callback):
    """Append one JSON line per event to ``path`` from rank 0: ``start`` (with the global step the
    fit starts at) and ``step`` (each optimizer step, with a hash of the batch it trained on)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._last = None

    def _write(self, trainer, **record) -> None:
        if trainer.global_rank == 0:
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(record) + "\n")

    def on_train_start(self, trainer, pl_module) -> None:
        self._last = trainer.global_step
        self._write(trainer, event="start", step=trainer.global_step, pid=os.getpid())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self._last:
            self._last = trainer.global_step
            digest = hashlib.sha1(batch.codes.cpu().numpy().tobytes()).hexdigest()[:16]
            self._write(
                trainer,
                event="step",
                step=trainer.global_step,
                epoch=trainer.current_epoch,
                batch_idx=batch_idx,
                batch=digest,
            )
