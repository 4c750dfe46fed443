"""`ModelCheckpoint` whose ``last.ckpt`` holds the run's last step.

Lightning 2.6 saves ``last`` at training's end only when the run saved none before
(``ModelCheckpoint.on_train_end``): a fit of 7 steps validated every 5 ended with ``last.ckpt`` at
step 5, and `export` or ``--ckpt_path last`` lost the last 2 steps. The `checkpoint:` of
`tts-lightning fit` is this class.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint


class LastStepCheckpoint(ModelCheckpoint):
    """`ModelCheckpoint`; with ``save_last``, ``last.ckpt`` is also saved at training's end when the
    last save was of an earlier step (every rank: a collective save under FSDP)."""

    @property
    def state_key(self) -> str:
        # ModelCheckpoint's: Lightning matches a checkpoint's callback state by this key, and the
        # runs saved with ModelCheckpoint would lose their best and top-k bookkeeping on resume.
        return "ModelCheckpoint" + super().state_key[len(type(self).__qualname__) :]

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.save_last and self._last_checkpoint_saved and self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        super().on_train_end(trainer, pl_module)
