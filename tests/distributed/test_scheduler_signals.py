"""A scheduler's signals in one process (the 1-GPU configs' world size 1, rehearsed on CPU with the
same strategy): SLURM's requeue signal saves `hpc_ckpt_1.ckpt` at the next batch's start, not from
inside the signal handler (where Lightning's handler would save a half-updated step); SIGTERM stops
at the next batch's start. Several processes: tests/distributed/test_fit_fsdp.py."""

import signal

import lightning as L
import pytest
from crash_callbacks import SignalAt
from lightning.pytorch.utilities.exceptions import SIGTERMException

from tts_lightning import Qwen3TTSModule
from tts_lightning.distributed.fsdp import Qwen3TTSFSDPStrategy
from tts_lightning.model.checkpoint import load_training_checkpoint


def test_one_process_saves_on_requeue_and_stops_on_sigterm_at_the_next_batch(
    tiny_dir, make_datamodule, tmp_path, monkeypatch
):
    slurm = {"SLURM_NTASKS": 1, "SLURM_NTASKS_PER_NODE": 1, "SLURM_NNODES": 1, "SLURM_PROCID": 0, "SLURM_LOCALID": 0}
    for name, value in {**slurm, "SLURM_NODEID": 0, "SLURM_JOB_ID": 77, "SLURM_JOB_NAME": "tts-lightning"}.items():
        monkeypatch.setenv(name, str(value))  # a task of a SLURM job: Lightning's auto-requeue is on
    data = make_datamodule()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=Qwen3TTSFSDPStrategy(state_dict_type="sharded"),
        use_distributed_sampler=False,
        max_steps=6,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        # in the backward of steps 2 and 4
        callbacks=[SignalAt(1, rank=0, signal="SIGUSR1"), SignalAt(3, rank=0, signal="SIGTERM")],
    )
    assert type(trainer.strategy.cluster_environment).__name__ == "SLURMEnvironment"
    # Python's default SIGTERM, as in a fresh process (a Ray test earlier in this worker leaves Ray's
    # handler, `sys.exit`, which Lightning's composed handler would call too).
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with pytest.raises(SIGTERMException):
            trainer.fit(Qwen3TTSModule(str(tiny_dir), speakers=data.speaker_names), datamodule=data)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert trainer.global_step == 4  # stopped before step 5
    assert load_training_checkpoint(tmp_path / "hpc_ckpt_1.ckpt").global_step == 2  # saved before step 3
    assert not list(tmp_path.glob(".*partial"))
