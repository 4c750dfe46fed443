"""Run by tests/model/test_step_host_reads.py: a fit with 2 FSDP ranks (started side by side by the
test) that records each training step's host reads (`tests/host_reads.py`) and writes them to
``<out>/rank<N>.json``. ``fsdp``: FSDP1 at 32-true; ``fsdp2``: FSDP2 at bf16-mixed (the 1-GPU
FSDP2 config's strategy and precision)."""

import json
import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import CSVLogger

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: host_reads
from host_reads import HostReads  # noqa: E402

from tts_lightning import Qwen3TTSModule, SpeakerClipsDataModule  # noqa: E402
from tts_lightning.cli import StepProgressBar  # noqa: E402
from tts_lightning.distributed.fsdp import Qwen3TTSFSDPStrategy  # noqa: E402
from tts_lightning.distributed.fsdp2 import Qwen3TTSFSDP2Strategy  # noqa: E402

STRATEGIES = {"fsdp": (Qwen3TTSFSDPStrategy, "32-true"), "fsdp2": (Qwen3TTSFSDP2Strategy, "bf16-mixed")}


def main(pretrained: str, manifest: str, cache: str, out: str, log_every: str, strategy: str) -> None:
    strategy_class, precision = STRATEGIES[strategy]
    data = SpeakerClipsDataModule(
        pretrained, manifest, val_fraction=0.15, cache_dir=cache, seed=0, max_frames_per_batch=150, num_workers=1
    )
    reads = HostReads()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy_class(),
        precision=precision,
        max_steps=2 * int(log_every),
        log_every_n_steps=int(log_every),
        gradient_clip_val=1.0,  # by the norm over both ranks' shards (Qwen3TTSFSDPPrecision)
        logger=CSVLogger(out),
        callbacks=[reads, StepProgressBar()],
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    trainer.fit(Qwen3TTSModule(pretrained, speakers=data.speaker_names), datamodule=data)
    steps = [
        {"step": r.step, "padded": r.padded, "syncs": r.syncs, "sites": dict(r.sites), "shape_reads": r.shape_reads}
        for r in reads.steps
    ]
    Path(out, f"rank{trainer.global_rank}.json").write_text(json.dumps(steps))


if __name__ == "__main__":
    main(*sys.argv[1:7])
