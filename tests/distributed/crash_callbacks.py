"""Callbacks the resume tests put into a real `tts-lightning fit` run (imported by the ranks
through PYTHONPATH)."""

import os
import signal

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


class SignalAt(Callback):
    """Rank ``rank`` gets ``signal`` (SIGTERM, or SLURM's requeue signal SIGUSR1) inside the backward
    of optimizer step ``step + 1`` (where Lightning's own handlers would broadcast or save while the
    other rank is in an FSDP collective); every rank must act on it at the start of the same later
    batch (SIGTERM: stop and exit with the SIGTERM status)."""

    def __init__(self, step: int, rank: int = 1, signal: str = "SIGTERM") -> None:
        self.step, self.rank = step, rank  # step -1: in the sanity check's first validation batch
        self.signal = signal

    def _send(self, trainer) -> None:
        print(f"[SignalAt] {self.signal} to rank {self.rank} at global_step {self.step}", flush=True)
        os.kill(os.getpid(), getattr(signal, self.signal))

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            self._send(trainer)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if self.step == -1 and trainer.sanity_checking and batch_idx == 0 and trainer.global_rank == self.rank:
            self._send(trainer)

    def on_exception(self, trainer, pl_module, exception) -> None:
        rank, step, name = trainer.global_rank, trainer.global_step, type(exception).__name__
        print(f"[SignalAt] rank {rank} stops after global_step {step}: {name}", flush=True)


class SigtermInValidation(Callback):
    """Rank 1 gets SIGTERM right after its validation batch ``batch`` of `validate` (while rank 0 may
    already be in the next batch's FSDP collectives, where Lightning's notifier broadcast from inside
    the handler); every rank must stop at the start of the same later batch."""

    def __init__(self, batch: int = 0) -> None:
        self.batch, self.started = batch, -1

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self.started = batch_idx

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if batch_idx == self.batch and trainer.global_rank == 1:
            print(f"[SigtermInValidation] SIGTERM to rank 1 after validation batch {batch_idx}", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)

    def on_exception(self, trainer, pl_module, exception) -> None:
        rank, name = trainer.global_rank, type(exception).__name__
        print(f"[SigtermInValidation] rank {rank} stops at validation batch {self.started}: {name}", flush=True)
