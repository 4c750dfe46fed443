"""Codec encoding split over the ranks of a real 2-process run (gloo) writes the same cache bytes
as a single process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tts_lightning.data.datamodule import SpeakerClipsDataModule
from tts_lightning.data.demo import demo_dir

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
import lightning as L
import torch
from tts_lightning.data.datamodule import SpeakerClipsDataModule

class Nothing(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
    def training_step(self, batch, batch_idx):
        return self.w * batch.codes.float().mean()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

pretrained, manifest, cache = sys.argv[1:4]
data = SpeakerClipsDataModule(pretrained, manifest, cache_dir=cache, max_frames_per_batch=400)
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    limit_val_batches=0, num_sanity_val_steps=0, use_distributed_sampler=False)
trainer.fit(Nothing(), data)
print(f"rank {trainer.global_rank}: {len(data.train_dataset)} train clips", flush=True)
"""


def _files(cache: Path) -> dict[str, bytes]:
    """The codes, the speaker embeddings and the index: what training reads."""
    paths = [*cache.glob("codes/*/*.npy"), *cache.glob("speakers/*"), cache / "prepared.json"]
    return {p.relative_to(cache).as_posix(): p.read_bytes() for p in paths}


@pytest.mark.slow  # multi-process or a model build: about a minute
def test_two_ranks_write_the_same_cache_as_one_process(tiny_dir, tmp_path):
    shutil.copytree(demo_dir(), tmp_path / "demo", ignore=shutil.ignore_patterns(".*"))
    manifest = tmp_path / "demo" / "train.jsonl"
    script = tmp_path / "two_ranks.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(script), str(tiny_dir), str(manifest), str(tmp_path / "parallel")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "rank 0: 22 train clips" in out and "rank 1: 22 train clips" in out
    # Rank 0 encoded half; after the barrier, nothing was left for it: rank 1 encoded the rest.
    assert "rank 0/2: codec cache: 12 clip(s) encoded, 0 already cached" in out
    assert "codec cache: 0 clip(s) encoded, 24 already cached" in out
    assert out.count("data report (") == 1

    SpeakerClipsDataModule(
        str(tiny_dir), str(manifest), cache_dir=str(tmp_path / "serial"), max_frames_per_batch=400
    ).prepare()
    parallel, serial = _files(tmp_path / "parallel"), _files(tmp_path / "serial")
    assert len([p for p in serial if p.endswith(".npy")]) == 24
    assert parallel.keys() == serial.keys()
    assert [p for p in serial if parallel[p] != serial[p]] == []
