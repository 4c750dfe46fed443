"""SpeakerSimilarity: an independent speaker-verification encoder tells voices apart, and the metric
accumulates over updates and reduces across real processes."""

import multiprocessing as mp

import numpy as np
import pytest
import torch

from tts_lightning.data.audio import load_audio
from tts_lightning.data.demo import demo_dir
from tts_lightning.metrics import SpeakerSimilarity, embed_utterances, reference_embedding

# Real speech shipped with the project (the demo speakers: two clearly different espeak-ng voices),
# so no test depends on a synthesiser being installed.
VOICES = {"a": "alice", "b": "bob"}
SR = 24_000


@pytest.fixture(scope="module")
def clips():
    root = demo_dir() / "clips"
    return {
        f"{v}{i}": load_audio(root / name / f"{name}_{i:03d}.flac", SR).numpy()
        for v, name in VOICES.items()
        for i in range(3)
    }, SR


def test_same_voice_scores_above_another_voice(clips):
    wavs, sr = clips
    same, other = SpeakerSimilarity(sample_rate=sr), SpeakerSimilarity(sample_rate=sr)
    same.update([wavs["a1"], wavs["a2"]], [wavs["a0"]])  # two more sentences of voice a vs a's reference
    other.update(wavs["b1"], [wavs["a0"]])  # voice b vs a's reference
    s, o = float(same.compute()), float(other.compute())
    assert s > o + 0.15, (s, o)
    assert -1.0 <= o < s <= 1.0
    # And the other way round: b's own sentence is closer to b than a's is.
    flipped_same, flipped_other = SpeakerSimilarity(sample_rate=sr), SpeakerSimilarity(sample_rate=sr)
    flipped_same.update(wavs["b2"], [wavs["b0"], wavs["b1"]])
    flipped_other.update(wavs["a2"], [wavs["b0"], wavs["b1"]])
    assert float(flipped_same.compute()) > float(flipped_other.compute()) + 0.15


def test_accumulates_over_updates(clips):
    wavs, sr = clips
    emb = {k: embed_utterances([w], sr)[0] for k, w in wavs.items()}
    assert all(abs(float(e.norm()) - 1.0) < 1e-4 for e in emb.values())
    ref_a = (emb["a0"] + emb["a1"]) / 2  # mean of unit-norm embeddings
    torch.testing.assert_close(reference_embedding([wavs["a0"], wavs["a1"]], sr), ref_a, atol=1e-5, rtol=0)

    metric = SpeakerSimilarity(sample_rate=sr)
    metric.update(wavs["a2"], [wavs["a0"], wavs["a1"]])
    metric.update({"a": [wavs["b2"]], "b": [wavs["b2"], wavs["a1"]]}, {"a": ref_a, "b": [wavs["b0"]]})
    cos = torch.nn.functional.cosine_similarity
    expected = [
        cos(emb["a2"], ref_a, dim=0),
        cos(emb["b2"], ref_a, dim=0),
        cos(emb["b2"], emb["b0"], dim=0),
        cos(emb["a1"], emb["b0"], dim=0),
    ]
    assert int(metric.count) == 4
    assert float(metric.compute()) == pytest.approx(float(torch.stack(expected).mean()), abs=1e-5)
    metric.reset()
    assert int(metric.count) == 0
    with pytest.warns(UserWarning, match="before the ``update``"):
        assert torch.isnan(metric.compute())
    with pytest.raises(KeyError, match="no reference"):
        metric.update({"c": [wavs["a0"]]}, {"a": [wavs["a0"]]})
    with pytest.raises(ValueError, match="empty or silent"):
        metric.update(np.zeros(sr, dtype=np.float32), ref_a)


def _rank(rank, world, init_file, gen, refs, sr, queue):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        metric = SpeakerSimilarity(sample_rate=sr)
        for wav in gen[rank]:  # unequal numbers of clips per rank, one update each
            metric.update(wav, refs)
        local = int(metric.count)
        queue.put((rank, local, float(metric.compute())))  # compute() reduces over both ranks
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_reduces_across_two_processes(clips, tmp_path):
    wavs, sr = clips
    refs = [wavs["a0"]]
    gen = {0: [wavs["a1"], wavs["b1"], wavs["b2"]], 1: [wavs["a2"]]}
    single = SpeakerSimilarity(sample_rate=sr)
    single.update(gen[0] + gen[1], refs)

    # fork: the ranks start with the encoder already loaded (no CUDA, no process group in the parent).
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, tmp_path / "rendezvous", gen, refs, sr, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert [(r, n) for r, n, _ in results] == [(0, 3), (1, 1)]
    for _, _, value in results:  # the mean over all 4 clips, on both ranks, not each rank's own
        assert value == pytest.approx(float(single.compute()), abs=1e-5)
