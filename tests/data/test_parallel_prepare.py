"""`prepare` split over the ranks of a run (file checks, codec encoding, speaker embeddings) writes
the same bytes as a single process: in a real 2-process run (gloo), and with four processes calling
the preparer directly on one shared cache folder or on a cache folder per node of two."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import time
from pathlib import Path

import pytest

from tts_lightning.data.datamodule import SpeakerClipsDataModule
from tts_lightning.data.demo import demo_dir
from tts_lightning.data.prepare import DataPreparer, PrepareSettings

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
    """Every file of the cache folder but the memo of file fingerprints (its order of entries is the
    order the processes wrote them): the codes, the speaker table, the index, the report and the
    validation memo; no part a rank left behind."""
    paths = [p for p in cache.rglob("*") if p.is_file() and p.name != "fingerprints.json"]
    return {p.relative_to(cache).as_posix(): p.read_bytes() for p in paths}


@pytest.mark.slow  # multi-process or a model build: about a minute
def test_two_ranks_write_the_same_cache_as_one_process(tiny_dir, tmp_path, run_script):
    shutil.copytree(demo_dir(), tmp_path / "demo", ignore=shutil.ignore_patterns(".*"))
    manifest = tmp_path / "demo" / "train.jsonl"
    script = tmp_path / "two_ranks.py"
    script.write_text(SCRIPT)
    proc = run_script(
        script, tiny_dir, manifest, tmp_path / "parallel", timeout=600, cwd=tmp_path, ranks=2, check=False
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "rank 0: 22 train clips" in out and "rank 1: 22 train clips" in out
    # Rank 0 encoded half, rank 1 the rest (the bytes below are complete), and nobody more.
    assert "rank 0/2: codec cache: 12 clip(s) encoded, 0 already cached" in out
    assert out.count("clip(s) encoded") == 1
    assert out.count("data report (") == 1

    SpeakerClipsDataModule(
        str(tiny_dir), str(manifest), cache_dir=str(tmp_path / "serial"), max_frames_per_batch=400
    ).prepare()
    parallel, serial = _files(tmp_path / "parallel"), _files(tmp_path / "serial")
    assert len([p for p in serial if p.endswith(".npy")]) == 24
    assert {"report.json", "prepared.json"} <= serial.keys() and len([p for p in serial if "validation/" in p]) == 1
    assert parallel.keys() == serial.keys()
    assert [p for p in serial if parallel[p] != serial[p]] == []


class Collectives:
    """`prepare_on_all_ranks`'s ``agree`` and ``gather`` for forked processes, as the strategy's
    ``reduce_boolean_decision(ok, all=True)`` and ``all_gather``: every rank posts its value, waits,
    reads them all."""

    def __init__(self, ctx, world: int) -> None:
        self.values = ctx.Array("q", world)
        self.gate = ctx.Barrier(world, timeout=300)

    def gather(self, rank: int, value: int) -> list[int]:
        self.values[rank] = value
        self.gate.wait()
        everyone = list(self.values)
        self.gate.wait()  # no rank posts again before every rank has read
        return everyone

    def agree(self, rank: int, ok: bool) -> bool:
        return all(self.gather(rank, ok))


WORLD = 4


def _rank_main(
    rank: int, tiny_dir: str, manifest: str, layouts: list[list[str]], collectives: Collectives, encoded
) -> None:
    """One rank of a run, preparing into each layout of cache folders (one per rank) in turn, twice.
    Each time as a run calls `prepare_on_all_ranks`: after ``prepare_data`` on each node's first
    rank (the first rank of each cache folder). ``encoded[layout * WORLD + rank]`` counts the clips
    the rank encoded. The second time any file check, encoding or embedding fails: a second run
    does none. First, a run whose validation fails on the finishing rank alone (every clip too
    short): every rank stops, each with its own error, none waits."""
    import tts_lightning.data.codec_cache as codec_cache
    import tts_lightning.data.prepare_ranks as prepare_ranks
    import tts_lightning.data.speakers as speakers
    import tts_lightning.data.validation as validation

    def fail(*args, **kwargs):
        raise AssertionError(f"rank {rank}: work done again {args[:1]}")

    encode_missing = codec_cache.CodecCache.encode_missing
    layout = 0

    def counted(self, clips, *args, **kwargs):
        assert kwargs.get("max_seconds") == PrepareSettings.encode_batch_seconds  # data.encode_batch_seconds reaches it
        n = encode_missing(self, clips, *args, **kwargs)
        encoded[layout * WORLD + rank] += n
        return n

    codec_cache.CodecCache.encode_missing = counted
    gate = collectives.gate
    agree, gather = (lambda ok: collectives.agree(rank, ok)), (lambda n: collectives.gather(rank, n))
    try:
        failing = DataPreparer(
            PrepareSettings(tiny_dir, manifest, cache_dir=str(Path(layouts[0][0]).parent / "fail"), min_duration=20.0)
        )
        expected = (ValueError, "no usable clips") if rank == 0 else (prepare_ranks.PrepareStopped, "while validating")
        with pytest.raises(expected[0], match=expected[1]):
            failing.prepare_on_all_ranks(WORLD, rank, agree=agree, gather=gather, device="cpu")
        for again in (False, True):
            if again:
                prepare_ranks.check_file = validation.check_file = fail
                codec_cache.CodecCache._get_tokenizer = fail
                speakers.SpeakerEncoder.embed_files = fail
            for layout, caches in enumerate(layouts):
                preparer = DataPreparer(PrepareSettings(tiny_dir, manifest, cache_dir=caches[rank]))
                if caches.index(caches[rank]) == rank:
                    preparer.read_manifests()  # prepare_data
                gate.wait()
                preparer.prepare_on_all_ranks(WORLD, rank, agree=agree, gather=gather, device="cpu")
    except BaseException:
        gate.abort()  # the other ranks stop waiting
        raise


@pytest.mark.slow  # a model build and 4 processes: about a minute
def test_ranks_sharing_a_cache_or_each_node_on_its_own_disk_write_the_bytes_of_one_process(tiny_dir, tmp_path):
    """4 ranks: all on one cache folder (shared storage), then two 'nodes' of 2 ranks, each node
    with a cache folder of its own. Each node's ranks split its whole copy between them: no rank
    encodes another node's share alone."""
    shutil.copytree(demo_dir(), tmp_path / "demo", ignore=shutil.ignore_patterns(".*"))
    manifest = tmp_path / "demo" / "train.jsonl"
    DataPreparer(PrepareSettings(str(tiny_dir), str(manifest), cache_dir=str(tmp_path / "serial"))).prepare()

    shared = [tmp_path / "shared"] * WORLD
    node_local = [tmp_path / "node0"] * 2 + [tmp_path / "node1"] * 2
    for cache in {*shared, *node_local}:  # what an interrupted run of 3 ranks left: swept
        stale = cache / "validation" / "parts" / "0123456789abcdef-2-of-3.json"
        stale.parent.mkdir(parents=True)
        stale.write_text("[]")
        # Half-written parts and a probe of ranks killed two hours ago (younger ones may be in use).
        for tmp in (
            stale.parent / ".x-0-of-2.json.ab12.tmp",
            cache / "speakers" / "parts" / ".k.pt.cd34.tmp",
            cache / "ranks" / ".00000000000001.tmp",
        ):
            tmp.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(b"half")
            os.utime(tmp, (time.time() - 7200, time.time() - 7200))
    ctx = multiprocessing.get_context("fork")  # the ranks start with this process's imports done
    collectives = Collectives(ctx, WORLD)
    layouts = [[str(c) for c in caches] for caches in (shared, node_local)]
    encoded = ctx.Array("i", len(layouts) * WORLD)
    procs = [
        ctx.Process(target=_rank_main, args=(r, str(tiny_dir), str(manifest), layouts, collectives, encoded))
        for r in range(WORLD)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(600)
    assert [proc.exitcode for proc in procs] == [0] * WORLD
    assert list((tmp_path / "fail" / "ranks").iterdir()) == []  # the failed run's probes are gone too
    serial = _files(tmp_path / "serial")
    assert len([p for p in serial if p.endswith(".npy")]) == 24
    for cache in {*shared, *node_local}:
        assert _files(cache) == serial, cache
    # The 24 clips dealt over the 4 ranks of the shared folder, over the 2 ranks of each node's.
    assert list(encoded) == [6] * WORLD + [12] * WORLD
