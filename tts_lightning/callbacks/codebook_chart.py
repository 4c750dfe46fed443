"""One TensorBoard chart of the per-codebook accuracies: a line per codebook beside their mean.

The module logs ``train/acc_codebook_{j}`` (``_step`` and ``_epoch``) and ``val/acc_codebook_{j}``;
this callback adds their mean (``train/acc_codebook_mean``, ``val/acc_codebook_mean``) and, once at
fit start, a custom-scalar layout (TensorBoard's "Custom Scalars" tab) that draws each stage's
codebooks and mean in one chart."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger

from tts_lightning.model.train_accuracy import writes_logs

CATEGORY = "codebook accuracy"


def layout() -> dict:
    """``{category: {chart: ["Multiline", [tag regexes]]}}``, the form `add_custom_scalars` takes."""
    return {
        CATEGORY: {
            "train (per step)": ["Multiline", [r"train/acc_codebook_\d+_step", r"train/acc_codebook_mean"]],
            "validation": ["Multiline", [r"val/acc_codebook_\d+$", r"val/acc_codebook_mean"]],
        }
    }


class CodebookAccuracyChart(Callback):
    """Logs the mean of the codebook accuracies and the chart layout that shows them together."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_custom_scalars(layout())

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args) -> None:
        # Only on the steps Lightning writes: the module logs the step accuracies on those alone, and
        # reading them back (a GPU stall) on the others would be wasted.
        if writes_logs(trainer):
            self._log_mean(trainer, pl_module, "train", "_step", on_step=True)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._log_mean(trainer, pl_module, "val", "", on_step=False)

    @staticmethod
    def _log_mean(trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str, suffix: str, on_step: bool) -> None:
        # callback_metrics holds this step's values here (computed when read), the same on every rank's call.
        groups = int(getattr(pl_module, "num_code_groups", 0))
        metrics = trainer.callback_metrics
        values = [metrics.get(f"{stage}/acc_codebook_{j}{suffix}") for j in range(groups)]
        found = [float(v) for v in values if v is not None]
        if groups and len(found) == groups:
            mean = sum(found) / groups
            # Validation's values are already synced (the same on every rank): averaging them again is
            # a no-op that keeps Lightning's epoch-level check quiet.
            pl_module.log(
                f"{stage}/acc_codebook_mean", mean, on_step=on_step, on_epoch=not on_step, sync_dist=not on_step
            )
