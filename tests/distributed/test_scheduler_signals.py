"""A scheduler's signals in one process (the 1-GPU configs' world size 1, rehearsed on CPU with the
same strategy): SLURM's requeue signal saves `hpc_ckpt_1.ckpt` at the end of the next batch that
steps the optimizer, not from inside the signal handler (where Lightning's handler saved a step
caught half-way, or mid-accumulation gradients that a checkpoint does not hold); SIGTERM stops at
the next batch's start. Several processes: tests/distributed/test_fit_fsdp.py."""

import os
import signal

import lightning as L
import pytest
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException

from tts_lightning import Qwen3TTSModule
from tts_lightning.distributed.fsdp import Qwen3TTSFSDPStrategy
from tts_lightning.model.checkpoint import load_training_checkpoint


class SignalInBatch(Callback):
    """``signal`` to this process inside the backward of the batch of index ``batch_idx``, once."""

    def __init__(self, batch_idx: int, signal: signal.Signals) -> None:
        self.batch_idx, self.signal, self.sent = batch_idx, signal, False

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if trainer.fit_loop.epoch_loop.batch_idx == self.batch_idx and not self.sent:
            self.sent = True
            os.kill(os.getpid(), self.signal)


def test_one_process_saves_on_requeue_at_a_step_end_and_stops_on_sigterm_at_the_next_batch(
    tiny_dir, make_datamodule, tmp_path, monkeypatch
):
    slurm = {"SLURM_NTASKS": 1, "SLURM_NTASKS_PER_NODE": 1, "SLURM_NNODES": 1, "SLURM_PROCID": 0, "SLURM_LOCALID": 0}
    for name, value in {**slurm, "SLURM_NODEID": 0, "SLURM_JOB_ID": 77, "SLURM_JOB_NAME": "tts-lightning"}.items():
        monkeypatch.setenv(name, str(value))  # a task of a SLURM job: Lightning's auto-requeue is on
    monkeypatch.setenv("PATH", str(tmp_path / "no-scontrol"))  # no SLURM to requeue with: Lightning logs it
    data = make_datamodule()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=Qwen3TTSFSDPStrategy(state_dict_type="sharded"),
        use_distributed_sampler=False,
        max_steps=6,
        accumulate_grad_batches=2,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        # The requeue signal in the second batch (the end of step 1): acted on from the third, which
        # accumulates, so saved at the end of the fourth (step 2). SIGTERM in the fifth: stop before
        # the sixth, still at step 2.
        callbacks=[SignalInBatch(1, signal.SIGUSR1), SignalInBatch(4, signal.SIGTERM)],
    )
    assert type(trainer.strategy.cluster_environment).__name__ == "SLURMEnvironment"
    # Python's default handlers, as in a fresh process (a Ray test earlier in this worker leaves Ray's
    # SIGTERM handler, `sys.exit`, which Lightning's composed handler would call too).
    previous = {s: signal.signal(s, signal.SIG_DFL) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        with pytest.raises(SIGTERMException):
            trainer.fit(Qwen3TTSModule(str(tiny_dir), speakers=data.speaker_names), datamodule=data)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    assert trainer.global_step == 2
    assert load_training_checkpoint(tmp_path / "hpc_ckpt_1.ckpt").global_step == 2  # at a step's end
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hpc_ckpt_1.ckpt"]  # once, nothing half-written
