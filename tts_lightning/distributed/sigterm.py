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
of each training batch the ranks learn whether any of them has noted it (an all-reduce over the
process group, read right after Lightning's own per-step read of its flag) and, if one has, all
stop there, as Lightning stops (its `SIGTERMException`). The checkpoints already written stay;
`tts-lightning` then exits with status 143 and one line (`tts_lightning.__main__`).
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

    def setup(self, trainer: Any) -> None:
        self._sigterm_noted = False
        super().setup(trainer)  # type: ignore[misc]

    def on_validation_start(self) -> None:
        super().on_validation_start()  # type: ignore[misc]
        if self.lightning_module.trainer.state.fn == "fit":  # type: ignore[attr-defined]
            self._take_over_sigterm()  # the sanity check: Lightning has registered its handlers by now

    def on_train_start(self) -> None:
        super().on_train_start()  # type: ignore[misc]
        self._take_over_sigterm()

    def _take_over_sigterm(self) -> None:
        connector = self.lightning_module.trainer._signal_connector  # type: ignore[attr-defined]
        self._sigterm_noted |= connector.received_sigterm  # Lightning's notifier had it first
        if threading.current_thread() is not threading.main_thread():
            return  # no signal handlers outside the main thread (Lightning registers none either)
        handlers = getattr(signal.getsignal(signal.SIGTERM), "signal_handlers", None)
        notifier = connector._sigterm_notifier_fn
        if handlers is not None and notifier in handlers:  # else not Lightning's (Windows, replaced): left alone
            handlers[handlers.index(notifier)] = self._note_sigterm

    def _note_sigterm(self, signum: int, frame: Any) -> None:
        launcher = self.launcher  # type: ignore[attr-defined]
        if not self._sigterm_noted and launcher is not None:
            launcher.kill(signum)  # the ranks Lightning started get it too, as with Lightning's notifier
        self._sigterm_noted = True

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]
        noted = self._sigterm_noted
        if self.world_size > 1:  # type: ignore[attr-defined]
            flag = torch.tensor([int(noted)], device=self.root_device)  # type: ignore[attr-defined]
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            # Read right after Lightning's own read of its flag at this batch's start, which has
            # drained the GPU's queue already: no further wait.
            noted = bool(flag.item())
        if noted:  # every rank, at the start of the same batch
            from lightning.pytorch.utilities.exceptions import SIGTERMException

            self.lightning_module.trainer._signal_connector.received_sigterm = True  # type: ignore[attr-defined]
            raise SIGTERMException()
