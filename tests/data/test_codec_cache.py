from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

import tts_lightning.data.codec_cache as codec_cache
from tts_lightning.data.audio import load_audio
from tts_lightning.data.codec_cache import SAMPLES_PER_FRAME, AudioChangedError, CodecCache, pad_to_frames
from tts_lightning.data.datamodule import SpeakerClipsDataModule
from tts_lightning.data.demo import demo_dir
from tts_lightning.data.manifest import load_manifest
from tts_lightning.data.validation import validate_clips
from tts_lightning.model.pretrained import check_pretrained, load_speech_tokenizer


@pytest.fixture
def demo_copy(tmp_path: Path) -> Path:
    """A writable copy of the shipped demo set; returns its train.jsonl."""
    shutil.copytree(demo_dir(), tmp_path / "demo", ignore=shutil.ignore_patterns(".*"))
    return tmp_path / "demo" / "train.jsonl"


@pytest.fixture
def encode_counter(monkeypatch):
    """Counts speech-tokenizer builds and encoded waveforms; the real tokenizer still runs."""
    counts = {"builds": 0, "clips": 0}

    def counting_loader(info, device="cpu"):
        tok = load_speech_tokenizer(info, device)
        counts["builds"] += 1
        real = tok.encode

        def encode(audios, *args, **kwargs):
            counts["clips"] += len(audios) if isinstance(audios, list) else 1
            return real(audios, *args, **kwargs)

        tok.encode = encode
        return tok

    monkeypatch.setattr(codec_cache, "load_speech_tokenizer", counting_loader)
    return counts


def _accepted(manifest: Path):
    return validate_clips(load_manifest(manifest).records).accepted


def test_second_prepare_encodes_nothing_and_a_rewritten_clip_is_reencoded(
    tiny_dir, demo_copy, encode_counter, monkeypatch
):
    import tts_lightning.data.validation_memo as validation_memo

    validations = []
    real_validate = validation_memo.validate_clips
    monkeypatch.setattr(
        validation_memo, "validate_clips", lambda *a, **k: validations.append(1) or real_validate(*a, **k)
    )

    data = SpeakerClipsDataModule(str(tiny_dir), str(demo_copy))
    data.prepare()
    assert encode_counter == {"builds": 1, "clips": 24} and len(validations) == 1
    files = lambda: sorted((data.cache_dir / "codes").rglob("*.npy"))  # noqa: E731
    assert len(files()) == 24

    data.prepare()  # fully cached: the tokenizer is not even built, the clips not even re-read
    assert encode_counter == {"builds": 1, "clips": 24} and len(validations) == 1

    clip = demo_copy.parent / "clips" / "alice" / "alice_003.flac"
    t = np.arange(int(1.7 * 24_000)) / 24_000
    sf.write(clip, (0.3 * np.sin(2 * np.pi * 330 * t)).astype(np.float32), 24_000, subtype="PCM_16")
    data.prepare()
    assert encode_counter == {"builds": 2, "clips": 25} and len(validations) == 2
    assert len(files()) == 25  # the old entry stays (content-keyed), a new one is added
    index = json.loads(data.prepared_path.read_text())
    entry = next(e for e in index["clips"] if e["audio"] == str(clip))
    assert entry["frames"] == -(-int(1.7 * 24_000) // SAMPLES_PER_FRAME)


def test_cached_codes_equal_tokenizer_encode_of_the_clip_padded_to_whole_frames(tiny_dir, demo_copy):
    info = check_pretrained(tiny_dir)
    clips = _accepted(demo_copy)
    # Different batch compositions must give the same files: pad-to-frames removes the dependence.
    batched = CodecCache(demo_copy.parent / "cache8", info)
    assert batched.encode_missing(clips, batch_size=8) == len(clips)
    alone = CodecCache(demo_copy.parent / "cache1", info)
    assert alone.encode_missing(clips[:6], batch_size=1) == 6

    tokenizer = load_speech_tokenizer(info)
    for clip in clips[:6]:
        wave = load_audio(clip.record.audio).numpy()
        expected = tokenizer.encode(pad_to_frames(wave), sr=24_000).audio_codes[0]
        got = batched.load(clip)
        assert got.dtype == torch.long and got.shape == (-(-len(wave) // SAMPLES_PER_FRAME), 16)
        assert torch.equal(got, expected.cpu())
        assert torch.equal(alone.load(clip), got)
        assert batched.path(clip).parent.name == batched.tokenizer_id
    # Nothing left to do.
    assert batched.encode_missing(clips, batch_size=8) == 0


def test_a_call_encodes_at_most_the_given_seconds_of_audio(tiny_dir, demo_copy, monkeypatch):
    """The encoder's activations grow with the seconds in a call, not its clips (~0.026 GiB a second in
    fp32 at the released size): a call holds at most ``data.encode_batch_seconds`` of audio (a longer
    clip alone) and ``data.encode_batch_size`` clips, and the codes are those of clip-count batches."""
    clips = _accepted(demo_copy)
    calls: list[list[float]] = []  # the durations encoded by each speech-tokenizer call
    real_batches = codec_cache._batches

    def recording(todo, size, seconds):
        batches = real_batches(todo, size, seconds)
        calls.extend([c.duration for c in batch] for batch in batches)
        return batches

    monkeypatch.setattr(codec_cache, "_batches", recording)
    data = SpeakerClipsDataModule(str(tiny_dir), str(demo_copy), encode_batch_seconds=6.0)
    data.prepare()
    assert sorted(d for call in calls for d in call) == sorted(c.duration for c in clips)  # each clip once
    assert all(sum(call) <= 6.0 or len(call) == 1 for call in calls) and all(len(call) <= 8 for call in calls)
    assert len(calls) >= len(clips) / 2  # the demo's 2-5 s clips: 1 or 2 a call instead of 8
    by_count = CodecCache(demo_copy.parent / "by-count", check_pretrained(tiny_dir))
    assert by_count.encode_missing(clips, batch_size=8) == len(clips)
    by_seconds = data.preparer.codec_cache()
    assert all(torch.equal(by_seconds.load(clip), by_count.load(clip)) for clip in clips)

    with pytest.raises(ValueError, match="data.encode_batch_size must be >= 1 and data.encode_batch_seconds > 0"):
        SpeakerClipsDataModule(str(tiny_dir), str(demo_copy), encode_batch_seconds=0)


def test_key_depends_on_content_and_preprocessing(tiny_dir, demo_copy):
    info = check_pretrained(tiny_dir)
    clip = _accepted(demo_copy)[0]
    plain = CodecCache(demo_copy.parent / "c", info)
    assert plain.key(clip) == CodecCache(demo_copy.parent / "other", info).key(clip)
    assert plain.key(clip) != CodecCache(demo_copy.parent / "c", info, normalize="peak").key(clip)
    assert plain.key(clip) != CodecCache(demo_copy.parent / "c", info, trim_silence=True).key(clip)
    assert len(plain.tokenizer_id) == 16


def test_manifest_codes_are_used_as_given_and_bad_ones_rejected(tiny_dir, demo_copy, encode_counter):
    root = demo_copy.parent
    lines = [json.loads(x) for x in demo_copy.read_text().splitlines()[:4]]
    lines = [e for e in lines] + [json.loads(x) for x in demo_copy.read_text().splitlines()[12:14]]
    rng = np.random.default_rng(0)
    lines[0]["audio_codes"] = rng.integers(0, 256, size=(26, 16)).tolist()  # 2.10 s of audio: 26.2 frames
    lines[1]["audio_codes"] = [[300] * 16] * 5  # outside the tiny codebook (256)
    lines[2]["audio_codes"] = [[1] * 8] * 5  # wrong width
    lines[3]["audio_codes"] = [[1] * 16] * 5  # 5 frames for 2.64 s of audio: another clip's codes
    manifest = root / "given.jsonl"
    manifest.write_text("".join(json.dumps(e) + "\n" for e in lines))

    data = SpeakerClipsDataModule(str(tiny_dir), str(manifest), cache_dir=str(root / "cache"))
    report = data.prepare()
    assert encode_counter["clips"] == 2  # lines 4..5; line 0 given, lines 1-3 rejected
    bad = {r.source: r for r in report.rejected}
    assert set(bad) == {"given.jsonl:2", "given.jsonl:3", "given.jsonl:4"}
    assert all(r.reason == "malformed_entry" for r in bad.values())
    assert "[0, 256)" in bad["given.jsonl:2"].detail
    assert "audio_codes has 5 frames, but its audio (2.64 s) makes about 33" in bad["given.jsonl:4"].detail

    index = json.loads(data.prepared_path.read_text())
    given = next(e for e in index["clips"] if e["source"] == "given.jsonl:1")
    assert given["frames"] == 26 and given["codes"].startswith("codes/manifest/")
    stored = np.load(data.cache_dir / given["codes"])
    assert np.array_equal(stored, np.asarray(lines[0]["audio_codes"]))


def test_a_clip_rewritten_after_validation_is_not_encoded_under_its_old_key(tiny_dir, demo_copy):
    clip = _accepted(demo_copy)[0]
    wave, sr = sf.read(clip.record.audio)
    sf.write(clip.record.audio, wave * 0.5, sr)  # edited while prepare runs
    cache = CodecCache(demo_copy.parent / "cache", check_pretrained(tiny_dir))
    with pytest.raises(AudioChangedError, match=f"^{re.escape(str(clip.record.audio))} changed after it was validated"):
        cache.encode_missing([clip])
    assert not cache.path(clip).exists()
