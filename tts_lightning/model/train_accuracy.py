"""The training accuracies per codebook, logged with two `self.log` calls per codebook per epoch and
one per logging step, instead of two per codebook on every step.

Each `self.log` call costs ~0.4-0.7 ms of Python in Lightning (`_ResultCollection.log` builds the
metadata and moves the stored result to the value's device on every call): the 32 calls per step
of 16 codebooks, ``_step`` and ``_epoch``, were ~13-23 ms of a ~450 ms CPU step in
``benchmarks/step_overhead.py --profile`` (docs/benchmarks.md, "The step itself"). Now:

* ``train/acc_codebook_<j>_step`` is logged only on the steps whose values Lightning writes
  (`writes_logs`); the values are the same, the other steps' were never written.
* ``train/acc_codebook_<j>_epoch`` is accumulated on the device (`EpochAccuracy`, two vector ops
  per step) with the arithmetic of Lightning's weighted mean, which it replaces: the sum of
  accuracy x targets counted over the sum of targets counted, each reduced over ranks with the
  strategy's ``mean`` as `self.log(..., sync_dist=True)` did, and logged once at epoch end
  (`CodebookEpochValue`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import lightning as L
from torch import Tensor, nn
from torchmetrics import Metric

from tts_lightning.model.loss import LossOutput, codebook_accuracy


def writes_logs(trainer: Any) -> bool:
    """Whether Lightning writes the values logged in this training step: its own flag
    (``log_every_n_steps``, or a stop), which its `LearningRateMonitor` and `ThroughputMonitor`
    check too, or a ``fast_dev_run`` (logged every step). True without a trainer."""
    connector = getattr(trainer, "_logger_connector", None)
    if connector is None:
        return True
    return bool(trainer.fast_dev_run) or bool(connector.should_update_logs)


class EpochAccuracy:
    """Per-codebook accuracy over an epoch's targets, accumulated on the device: what `self.log`
    of each codebook's batch accuracy with ``batch_size`` = its targets counted and ``on_epoch=True``
    computed (a float32 sum of value x batch size, an int64 sum of batch sizes, each reduced over
    ranks with the strategy's ``mean``, then divided), as one (G,) tensor each rather than G results."""

    def __init__(self) -> None:
        self.weighted: Tensor | None = None
        self.counted: Tensor | None = None
        self.reduce: Callable[..., Tensor] | None = None  # the strategy's, set at epoch end
        self._result: Tensor | None = None

    def reset(self) -> None:
        self.weighted = self.counted = self._result = None

    def update(self, accuracy: Tensor, counted: Tensor) -> None:
        """``accuracy`` (G,) float32 and ``counted`` (G,) int64 of one batch (`codebook_accuracy`)."""
        accuracy, counted = accuracy.detach(), counted.detach()
        if self.weighted is None or self.counted is None:
            self.weighted, self.counted = accuracy.new_zeros(accuracy.shape), counted.new_zeros(counted.shape)
        self.weighted = self.weighted + accuracy * counted
        self.counted = self.counted + counted
        self._result = None

    def result(self) -> Tensor:
        """The epoch's accuracies (G,), the same on every rank (two all-reduces, once per epoch)."""
        if self._result is None:
            assert self.weighted is not None and self.counted is not None
            weighted, counted = self.weighted.clone(), self.counted.clone()  # reduce works in place
            if self.reduce is not None:
                weighted, counted = self.reduce(weighted, reduce_op="mean"), self.reduce(counted, reduce_op="mean")
            self._result = weighted / counted
        return self._result


class CodebookEpochValue(Metric):
    """Codebook ``j``'s value of an `EpochAccuracy`, logged as a torchmetrics `Metric` so that
    Lightning computes it, and the reduction over ranks runs, where it computes its own epoch
    values: in the same order on every rank (rank 0's progress bar reads them before the module's
    ``on_train_epoch_end``, the other ranks after it)."""

    full_state_update = False

    def __init__(self, source: EpochAccuracy, j: int) -> None:
        super().__init__(sync_on_compute=False)  # `source` reduces
        self.source, self.j = source, j

    def update(self) -> None:
        """Nothing to add: the source accumulates (called once per epoch so that `compute` may run)."""

    def compute(self) -> Tensor:
        return self.source.result()[self.j]


class TrainAccuracyLogging(L.LightningModule):
    """`Qwen3TTSModule`'s training accuracies: ``_step`` is this rank's batch, logged on the steps
    Lightning writes; ``_epoch`` is the accuracy over all the epoch's targets (`EpochAccuracy`),
    logged at epoch end. Names as before: ``train/acc_codebook_<j>_step`` and ``_epoch``."""

    num_code_groups: int
    _train_accuracy: EpochAccuracy
    train_accuracy_epoch: nn.ModuleList  # of CodebookEpochValue

    def _log_train_accuracy(self, out: LossOutput, n: int) -> None:
        accuracy, counted = codebook_accuracy(out)  # a few device ops for all codebooks
        self._train_accuracy.update(accuracy, counted)
        if writes_logs(self._trainer):
            names = [f"train/acc_codebook_{j}_step" for j in range(self.num_code_groups)]
            self.log_dict(dict(zip(names, accuracy)), on_step=True, on_epoch=False, batch_size=n)

    def on_train_epoch_start(self) -> None:
        self._train_accuracy.reset()

    def on_train_epoch_end(self) -> None:
        if self._train_accuracy.weighted is None:
            return  # no training step this epoch
        self._train_accuracy.reduce = self.trainer.strategy.reduce
        for j, value in enumerate(cast(Sequence[CodebookEpochValue], self.train_accuracy_epoch)):
            value.update()
            self.log(f"train/acc_codebook_{j}_epoch", value, on_step=False, on_epoch=True)
