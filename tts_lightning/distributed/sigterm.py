"""SIGTERM stops a training run before the next batch, the same batch on every rank.

SIGTERM is how schedulers preempt a job (SLURM, Kubernetes) and how torchrun and Lightning's own
launcher pass a stop on to the ranks. Lightning 2.6's handler broadcasts a flag from inside the
signal handler, wherever the signal lands: in the backward, say, while the other ranks are inside
an FSDP collective, so the two collectives meet each other (a hang until the process group's
timeout, or gloo's "collective mismatch"); and its loop stops each rank at the end of the batch in
which that rank saw the signal, a different batch where ranks see it at different times.

`StopOnSigterm` (a mixin of the FSDP strategies) keeps Lightning's handlers but swaps its notifier
for one that only notes the signal and, like Lightning's, passes it on to the processes Lightning
started (from the sanity check on: Lightning registers its handlers just before it). At the start
of each training batch the ranks all-reduce the note, and all stop (as Lightning stops: its
`SIGTERMException`) at the start of the batch after the one whose all-reduce saw it, the first
batch's own where the signal came before training. The result is copied to the host without
waiting and read one batch later, when the GPU is long past it: no step waits for the GPU's queue
to drain (Lightning's own per-step broadcast and read of its flag, which can no longer be set once
its notifier is gone, is switched off: an open Lightning PR, #21640, makes it optional). The
checkpoints already written stay; `tts-lightning` then exits with status 143 and one line
(`tts_lightning.__main__`).
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import torch


class StopOnSigterm:
    """Mixin for a Lightning strategy: SIGTERM stops training before the same batch on every rank
    (module docstring)."""

    _sigterm_noted = False
    _sigterm_pending: _Agreement | None = None

    def setup(self, trainer: Any) -> None:
        self._sigterm_noted, self._sigterm_pending = False, None
        super().setup(trainer)  # type: ignore[misc]

    def on_validation_start(self) -> None:
        super().on_validation_start()  # type: ignore[misc]
        if self.lightning_module.trainer.state.fn == "fit":  # type: ignore[attr-defined]
            self._take_over_sigterm()  # the sanity check: Lightning has registered its handlers by now

    def on_train_start(self) -> None:
        super().on_train_start()  # type: ignore[misc]
        self._take_over_sigterm()

    def _take_over_sigterm(self) -> None:
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        connector = trainer._signal_connector
        self._sigterm_noted |= connector.received_sigterm  # Lightning's notifier had it first
        notifier = connector._sigterm_notifier_fn
        handlers = getattr(signal.getsignal(signal.SIGTERM), "signal_handlers", None)
        # No signal handlers outside the main thread (Lightning registers none either); a handler that
        # is not Lightning's (Windows, replaced) is left alone.
        if threading.current_thread() is threading.main_thread() and handlers is not None and notifier in handlers:
            handlers[handlers.index(notifier)] = self._note_sigterm
        if handlers is None or notifier not in handlers:
            # Only Lightning's notifier sets the flag that Lightning broadcasts and reads back at every
            # batch's start (a wait for the GPU's queue to drain, each step): without it, 0 every time.
            trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = _nothing

    def _note_sigterm(self, signum: int, frame: Any) -> None:
        launcher = self.launcher  # type: ignore[attr-defined]
        if not self._sigterm_noted and launcher is not None:
            launcher.kill(signum)  # the ranks Lightning started get it too, as with Lightning's notifier
        self._sigterm_noted = True

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]
        noted = self._sigterm_noted
        if self.world_size > 1:  # type: ignore[attr-defined]
            previous = self._sigterm_pending  # the previous batch's all-reduce: long done
            agreed = previous.result() if previous is not None else None
            self._sigterm_pending = _Agreement(noted, self.root_device)  # type: ignore[attr-defined]
            noted = agreed if agreed is not None else self._sigterm_pending.result()  # the first batch waits
        if noted:  # every rank, at the start of the same batch
            from lightning.pytorch.utilities.exceptions import SIGTERMException

            self.lightning_module.trainer._signal_connector.received_sigterm = True  # type: ignore[attr-defined]
            raise SIGTERMException()


class _Agreement:
    """Whether any rank has noted a SIGTERM: an all-reduce of each rank's note, queued on the device
    and copied to the host without waiting; `result()` waits for that copy only, not for the work
    queued after it. The CUDA branch (pinned memory, an event) runs in benchmarks/gpu_check.sh's
    real-size runs (world 4 of a fake process group); on the CPU the copy is done when queued."""

    def __init__(self, noted: bool, device: torch.device) -> None:
        flag = torch.full((1,), int(noted), dtype=torch.int32, device=device)  # no host-to-device copy
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        cuda = device.type == "cuda"
        self.host = torch.empty(1, dtype=torch.int32, pin_memory=cuda)
        self.host.copy_(flag, non_blocking=cuda)
        self.copied = torch.cuda.Event() if cuda else None
        if self.copied is not None:
            self.copied.record()

    def result(self) -> bool:
        if self.copied is not None:
            self.copied.synchronize()
        return bool(self.host.item())


def _nothing() -> None:
    pass
