"""A scheduler's signals to a training run, acted on between batches, at the same batch on every rank.

SIGTERM is how schedulers preempt a job (SLURM, Kubernetes) and how torchrun and Lightning's own
launcher pass a stop on to the ranks; SLURM's requeue signal (SIGUSR1, where the job asks for it
with ``--signal``) tells a run with Lightning's auto-requeue to save a checkpoint and requeue itself.
Lightning 2.6 acts on both inside the signal handler, wherever the signal lands: its SIGTERM
notifier broadcasts a flag, its requeue handler saves a checkpoint (gathers and writes on every
rank), in the backward, say, while the other ranks are inside an FSDP collective, so the
collectives meet each other (a hang until the process group's timeout, gloo's "collective
mismatch", or a checkpoint made of different steps); and its loop stops each rank at the end of the
batch in which that rank saw SIGTERM, a different batch where ranks see it at different times.

`SchedulerSignals` (a mixin of the FSDP strategies) keeps Lightning's handlers but swaps those two
for ones that only note the signal (the SIGTERM one, like Lightning's, passes it on to the
processes Lightning started), from the first batch of a fit's sanity check, of `validate`, `test`
or `predict` on (Lightning registers its handlers just before). At the start of each batch,
training or not, the ranks all-reduce their notes, and act on the all-reduce of the batch before
(the first batch waits for its own): on SIGTERM all stop there (as Lightning stops: its
`SIGTERMException`); on the requeue signal (in a fit: `validate`, `test` and `predict` only note
it, since Lightning's handler would save a checkpoint without optimizer state from inside the
signal handler, which a later fit in the folder would resume from) every rank runs Lightning's requeue
handler at the end of that batch or, accumulating gradients, of the first later one that steps the
optimizer: where `ModelCheckpoint` saves, so the checkpoint holds one step on every rank and
resumes as its checkpoints do. The all-reduce's result is copied to the host without waiting and
read one batch later, when the GPU is long past it: no step waits for the GPU's queue to drain
(Lightning's own per-step broadcast and read of its SIGTERM flag, which can no longer be set once
its notifier is gone, is switched off: an open Lightning PR, #21640, makes it optional). After a
SIGTERM the checkpoints already written stay; `tts-lightning` exits with status 143 and one line
(`tts_lightning.__main__`).
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback


class SchedulerSignals:
    """Mixin for a Lightning strategy: SIGTERM and SLURM's requeue signal acted on before the same
    batch on every rank (module docstring)."""

    _sigterm_noted = False
    _requeue_noted = False
    _requeued = False
    _requeue_due = False
    _signals_pending: _Agreement | None = None

    def setup(self, trainer: Any) -> None:
        self._sigterm_noted = self._requeue_noted = self._requeued = self._requeue_due = False
        self._signals_pending = None
        super().setup(trainer)  # type: ignore[misc]
        if not any(isinstance(c, _SignalsAtBatches) for c in trainer.callbacks):
            trainer.callbacks.append(_SignalsAtBatches())  # stateless: nothing in the checkpoints

    # Lightning has registered its handlers by the time each of these runs (the first: a fit's
    # sanity check); taking over again is a no-op.
    def on_validation_start(self) -> None:
        super().on_validation_start()  # type: ignore[misc]
        self._take_over_signals()

    def on_test_start(self) -> None:
        super().on_test_start()  # type: ignore[misc]
        self._take_over_signals()

    def on_predict_start(self) -> None:
        super().on_predict_start()  # type: ignore[misc]
        self._take_over_signals()

    def on_train_start(self) -> None:
        super().on_train_start()  # type: ignore[misc]
        self._take_over_signals()

    def _take_over_signals(self) -> None:
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        connector = trainer._signal_connector
        self._sigterm_noted |= connector.received_sigterm  # Lightning's notifier had it first
        # Lightning registers no handlers outside the main thread, nor SIGTERM's on Windows: its
        # notifier never runs there. A handler that is not Lightning's (replaced) is left alone.
        main = threading.current_thread() is threading.main_thread()
        notifier = connector._sigterm_notifier_fn
        if not main or sys.platform == "win32" or _swap(signal.SIGTERM, notifier, self._note_sigterm):
            # Only Lightning's notifier sets the flag that Lightning broadcasts and reads back at every
            # batch's start (a wait for the GPU's queue to drain, each step): without it, 0 every time.
            trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = _nothing
        requeue_signal = getattr(self.cluster_environment, "requeue_signal", None)  # type: ignore[attr-defined]
        if main and requeue_signal is not None:  # SLURM: Lightning's handler with auto-requeue
            _swap(requeue_signal, connector._slurm_sigusr_handler_fn, self._note_requeue)

    def _note_sigterm(self, signum: int, frame: Any) -> None:
        launcher = self.launcher  # type: ignore[attr-defined]
        if not self._sigterm_noted and launcher is not None:
            launcher.kill(signum)  # the ranks Lightning started get it too, as with Lightning's notifier
        self._sigterm_noted = True

    def _note_requeue(self, signum: int, frame: Any) -> None:
        self._requeue_noted = True

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]
        self.act_on_signals()

    def act_on_signals(self) -> None:
        """At a batch's start (a training batch: `on_train_batch_start`; another: `_SignalsAtBatches`),
        on every rank: agree on the signals noted and act on those agreed a batch ago."""
        sigterm, requeue = self._sigterm_noted, self._requeue_noted
        if self.world_size > 1:  # type: ignore[attr-defined]
            previous = self._signals_pending  # the previous batch's all-reduce: long done
            agreed = previous.result() if previous is not None else None
            self._signals_pending = _Agreement((sigterm, requeue), self.root_device)  # type: ignore[attr-defined]
            sigterm, requeue = agreed if agreed is not None else self._signals_pending.result()  # the first batch waits
        self._requeue_due = requeue and not self._requeued  # the same on every rank
        if sigterm:
            from lightning.pytorch.utilities.exceptions import SIGTERMException

            self.lightning_module.trainer._signal_connector.received_sigterm = True  # type: ignore[attr-defined]
            raise SIGTERMException()

    def requeue_if_due(self, trainer: Any) -> None:
        """At the end of a training batch that stepped the optimizer (`_SignalsAtBatches`), after the
        requeue signal was agreed on: Lightning's handler, once, on every rank (loggers finalized,
        `hpc_ckpt_<n>.ckpt` in the run's folder, which the requeued job resumes from, and SLURM's
        requeue from global rank 0)."""
        if self._requeue_due and not trainer.fit_loop.epoch_loop._should_accumulate():
            self._requeue_due, self._requeued = False, True
            trainer._signal_connector._slurm_sigusr_handler_fn(self.cluster_environment.requeue_signal, None)  # type: ignore[attr-defined]


class _SignalsAtBatches(Callback):
    """Runs the strategy's `SchedulerSignals.act_on_signals` at the start of each batch that is not
    a training batch (the strategy has no hook there), and its `requeue_if_due` at the end of each
    training batch, where `ModelCheckpoint` saves."""

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if isinstance(trainer.strategy, SchedulerSignals):
            trainer.strategy.requeue_if_due(trainer)

    def _act(self, trainer: Any) -> None:
        if isinstance(trainer.strategy, SchedulerSignals):
            trainer.strategy.act_on_signals()

    def on_validation_batch_start(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        self._act(trainer)

    def on_test_batch_start(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        self._act(trainer)

    def on_predict_batch_start(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        self._act(trainer)


def _swap(signum: int, theirs: Any, ours: Any) -> bool:
    """Put ``ours`` in place of Lightning's ``theirs`` inside Lightning's composed handler of
    ``signum`` (main thread only); whether ``ours`` is there."""
    handlers = getattr(signal.getsignal(signum), "signal_handlers", None)
    if handlers is None:
        return False
    if theirs in handlers:
        handlers[handlers.index(theirs)] = ours
    return ours in handlers


class _Agreement:
    """Whether any rank has noted each signal: an all-reduce of every rank's notes, queued on the
    device and copied to the host without waiting; `result()` waits for that copy only, not for the
    work queued after it. The CUDA branch (pinned memory, an event) runs in benchmarks/gpu_check.sh's
    real-size runs (world 4 of a fake process group); on the CPU the copy is done when queued."""

    def __init__(self, noted: tuple[bool, bool], device: torch.device) -> None:
        flags = torch.zeros(len(noted), dtype=torch.int32, device=device)  # no host-to-device copy
        for i, flag in enumerate(noted):
            if flag:
                flags[i] = 1
        # MAX, not a bitwise OR of one integer: NCCL has no bitwise reductions (gloo has).
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        cuda = device.type == "cuda"
        self.host = torch.empty(len(noted), dtype=torch.int32, pin_memory=cuda)
        self.host.copy_(flags, non_blocking=cuda)
        self.copied = torch.cuda.Event() if cuda else None
        if self.copied is not None:
            self.copied.record()

    def result(self) -> tuple[bool, bool]:
        if self.copied is not None:
            self.copied.synchronize()
        sigterm, requeue = self.host.tolist()
        return bool(sigterm), bool(requeue)


def _nothing() -> None:
    pass
