"""A callback the resume test puts into a real `tts-lightning fit` run (imported by the ranks
through PYTHONPATH)."""

import os

from lightning.pytorch import Callback


class CrashAt(Callback):
    """Every rank dies (``os._exit``, no cleanup, as a killed job would) just before optimizer step
    ``step + 1``: the work since the last checkpoint is lost and must be redone on resume."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            print(f"[CrashAt] rank {trainer.global_rank} exits at global_step {self.step}", flush=True)
            os._exit(1)
