from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf
import torch

from tts_lightning.data.audio import load_audio
from tts_lightning.data.demo import demo_dir
from tts_lightning.data.manifest import load_manifest
from tts_lightning.data.speakers import (
    SpeakerEncoder,
    SpeakerReference,
    compute_speaker_table,
    embed_speakers,
    load_speaker_table,
    select_references,
)
from tts_lightning.data.validation import validate_clips
from tts_lightning.model.pretrained import check_pretrained


@pytest.fixture(scope="module")
def demo_accepted():
    return validate_clips(load_manifest(demo_dir() / "train.jsonl").records).accepted


def _voice(seconds: float, sr: int, seed: int = 0) -> np.ndarray:
    """A harmonic tone with a little noise: enough structure for the speaker encoder."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    wave = sum(np.sin(2 * np.pi * f * t) / (i + 1) for i, f in enumerate((140, 280, 420, 560)))
    return (0.2 * wave + 0.01 * rng.standard_normal(t.shape)).astype(np.float32)


def test_embedding_equals_the_models_extract_speaker_embedding(tiny_dir):
    from qwen_tts import Qwen3TTSModel

    clip = demo_dir() / "clips" / "alice" / "alice_001.flac"
    wav = load_audio(clip).numpy()
    model = Qwen3TTSModel.from_pretrained(str(tiny_dir), dtype=torch.float32).model.float()
    expected = model.extract_speaker_embedding(wav, 24_000).float()

    encoder = SpeakerEncoder(check_pretrained(tiny_dir))
    got = encoder.embed_files([clip])
    assert got.dtype == torch.float32 and got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_references_at_any_rate_channels_and_length(tiny_dir, tmp_path):
    info = check_pretrained(tiny_dir)
    stereo48 = tmp_path / "ref48.wav"
    sf.write(stereo48, np.stack([_voice(2.0, 48_000)] * 2, axis=1), 48_000)
    mono16 = tmp_path / "ref16.flac"
    sf.write(mono16, _voice(1.3, 16_000, seed=1), 16_000)
    mono24 = tmp_path / "ref24.wav"
    sf.write(mono24, _voice(2.0, 24_000), 24_000, subtype="FLOAT")

    refs = {
        "a": [SpeakerReference(stereo48, "h48")],
        "b": [SpeakerReference(mono16, "h16"), SpeakerReference(mono24, "h24")],  # different lengths
    }
    table = compute_speaker_table(tmp_path / "cache", info, refs)
    assert table.names == ["a", "b"] and table.embeddings.dtype == torch.float32
    assert table.embeddings.shape == (2, info.config["speaker_encoder_config"]["enc_dim"])
    assert torch.isfinite(table.embeddings).all()

    encoder = SpeakerEncoder(info)
    # b is the fp32 mean of its references, each encoded on its own.
    mean = torch.stack([encoder.embed_files([mono16]), encoder.embed_files([mono24])]).mean(0)
    torch.testing.assert_close(table.embeddings[1], mean)
    # a is its 48 kHz stereo clip read as every clip is (`load_audio`: mono, 24 kHz; tested in
    # test_audio.py), exactly; and the same voice at 24 kHz mono gives nearly the same embedding.
    torch.testing.assert_close(table.embeddings[0], encoder.embed(load_audio(stereo48).reshape(-1)))
    cos = torch.nn.functional.cosine_similarity(table.embeddings[0], encoder.embed_files([mono24]), dim=0)
    assert cos > 0.99


def test_speaker_cache_recomputes_only_changed_speakers(tiny_dir, tmp_path, monkeypatch):
    info = check_pretrained(tiny_dir)
    clips = demo_dir() / "clips"
    refs = {
        "alice": [SpeakerReference(clips / "alice" / "alice_000.flac", "a0")],
        "bob": [SpeakerReference(clips / "bob" / "bob_000.flac", "b0")],
    }
    calls = []
    real = SpeakerEncoder.embed_files
    monkeypatch.setattr(
        SpeakerEncoder, "embed_files", lambda self, paths, **kw: calls.append(paths) or real(self, paths, **kw)
    )

    first = compute_speaker_table(tmp_path, info, refs)
    assert len(calls) == 2
    again = compute_speaker_table(tmp_path, info, refs)
    assert len(calls) == 2 and torch.equal(again.embeddings, first.embeddings)

    refs["bob"] = [SpeakerReference(clips / "bob" / "bob_001.flac", "b1")]
    changed = compute_speaker_table(tmp_path, info, refs)
    assert len(calls) == 3 and calls[-1] == [clips / "bob" / "bob_001.flac"]
    assert torch.equal(changed.embeddings[0], first.embeddings[0])
    assert not torch.equal(changed.embeddings[1], first.embeddings[1])

    stored = torch.load(changed.path, weights_only=True)
    assert stored["speakers"] == ["alice", "bob"] and stored["embeddings"].dtype == torch.float32
    assert changed.path.parent.name == "speakers" and changed.path.stem == SpeakerEncoder(info).fingerprint
    loaded = load_speaker_table(changed.path, ["bob", "alice"], [changed.keys[1], changed.keys[0]])
    assert torch.equal(loaded.embeddings, changed.embeddings.flip(0))
    with pytest.raises(FileNotFoundError, match="bob"):
        load_speaker_table(changed.path, ["bob"], [first.keys[1]])


def test_reference_selection(demo_accepted):
    # The demo records name ref_audio: alice_000 / bob_000.
    refs = select_references(demo_accepted, ["bob", "alice"])
    assert list(refs) == ["bob", "alice"]
    assert [r.path.name for r in refs["alice"]] == ["alice_000.flac"]
    by_path = {c.record.audio: c.content_hash for c in demo_accepted}
    assert refs["alice"][0].content_hash == by_path[refs["alice"][0].path]

    # Without ref_audio: the first num_reference_clips clips by path, whatever the input order.
    from dataclasses import replace

    bare = [replace(c, record=replace(c.record, ref_audio=None)) for c in reversed(demo_accepted)]
    refs = select_references(bare, ["alice"], num_reference_clips=2)
    assert [r.path.name for r in refs["alice"]] == ["alice_000.flac", "alice_001.flac"]

    # Records that each name a reference of their own (the clip itself): at most num_reference_clips,
    # by path, not one per clip (thousands at scale, each embedded and loaded by the samples callback).
    own = [replace(c, record=replace(c.record, ref_audio=c.record.audio)) for c in reversed(demo_accepted)]
    refs = select_references(own, ["alice", "bob"], num_reference_clips=3)
    assert [r.path.name for r in refs["alice"]] == ["alice_000.flac", "alice_001.flac", "alice_002.flac"]
    assert [r.path.name for r in refs["bob"]] == ["bob_000.flac", "bob_001.flac", "bob_002.flac"]


def test_a_truncated_speaker_part_is_computed_again_and_never_left_behind(tiny_dir, tmp_path, monkeypatch):
    """What a rank killed while writing its speaker part (or a damaged disk) leaves: `embed_speakers`
    writes it again, `compute_speaker_table` computes the speaker and removes the bad file."""
    info = check_pretrained(tiny_dir)
    refs = {"alice": [SpeakerReference(demo_dir() / "clips" / "alice" / "alice_000.flac", "a0")]}
    calls = []
    real = SpeakerEncoder.embed_files
    monkeypatch.setattr(
        SpeakerEncoder, "embed_files", lambda self, paths, **kw: calls.append(paths) or real(self, paths, **kw)
    )
    embed_speakers(tmp_path, info, refs, ["alice"])
    (part,) = (tmp_path / "speakers" / "parts").iterdir()
    good = part.read_bytes()
    part.write_bytes(good[: len(good) // 2])
    embed_speakers(tmp_path, info, refs, ["alice"])
    assert len(calls) == 2 and part.read_bytes() == good

    part.write_bytes(good[: len(good) // 2])
    table = compute_speaker_table(tmp_path, info, refs)
    assert len(calls) == 3 and list(part.parent.iterdir()) == []
    assert torch.equal(table.embeddings[0], torch.load(io.BytesIO(good), weights_only=True).float())
