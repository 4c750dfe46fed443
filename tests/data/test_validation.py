from __future__ import annotations

import hashlib
import json
import math
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
import torchaudio

from tts_lightning.data.demo import demo_dir
from tts_lightning.data.manifest import ClipRecord, ManifestResult, load_manifest
from tts_lightning.data.validation import FileCheck, ValidationConfig, check_file, files_to_check, validate_clips
from tts_lightning.data.validation_memo import validate_with_memo

CONFIG = ValidationConfig(min_duration=0.5, max_duration=3.0, silence_threshold_db=-50.0)


@pytest.fixture
def bad_dataset(tmp_path: Path, write_tone) -> Path:
    """A JSONL manifest in which every entry but two exercises a different rejection reason."""
    root = tmp_path / "ds"
    w = root / "wavs"
    write_tone(w / "good.wav", seconds=1.0, freq=200)
    write_tone(w / "good2.flac", seconds=1.2, freq=260, sr=48_000, channels=2)
    shutil.copy(w / "good.wav", w / "copy_of_good.wav")
    write_tone(w / "short.wav", seconds=0.2, freq=300)
    write_tone(w / "long.wav", seconds=3.5, freq=310)
    write_tone(w / "empty_text.wav", seconds=1.0, freq=320)
    write_tone(w / "noref.wav", seconds=1.0, freq=330)
    sf.write(w / "silent.wav", np.zeros(24_000, dtype=np.float32), 24_000)
    (w / "zero.wav").write_bytes(b"")
    (w / "text.wav").write_text("hello, I am a text file with a .wav name\n" * 10)
    whole = write_tone(w / "to_cut.wav", seconds=1.0, freq=340).read_bytes()
    (w / "truncated.wav").write_bytes(whole[: len(whole) // 2])
    (w / "to_cut.wav").unlink()
    flac = write_tone(w / "to_cut.flac", seconds=1.0, freq=350).read_bytes()
    (w / "truncated.flac").write_bytes(flac[: len(flac) // 2])
    (w / "to_cut.flac").unlink()
    # Loud channels, nothing to hear: a constant offset, and stereo whose mono mix cancels out.
    sf.write(w / "dc.wav", np.full(24_000, 0.05, dtype=np.float32), 24_000)
    tone = sf.read(write_tone(w / "antiphase.wav", seconds=1.0, freq=360), dtype="float32")[0]
    sf.write(w / "antiphase.wav", np.stack([tone, -tone], axis=1), 24_000)
    write_tone(w / "ref_text.wav", seconds=1.0, freq=370)
    write_tone(w / "ref_silent.wav", seconds=1.0, freq=380)
    write_tone(w / "ref_long_silent.wav", seconds=1.0, freq=390)
    sf.write(w / "silent_long.wav", np.zeros(84_000, dtype=np.float32), 24_000)  # 3.5 s: past max_duration

    entries = [
        ("wavs/good.wav", "Good clip."),
        ("wavs/good2.flac", "Another good clip."),
        ("wavs/copy_of_good.wav", "Same bytes as the first."),
        ("wavs/good.wav", "Same path again."),
        ("wavs/short.wav", "Too short."),
        ("wavs/long.wav", "Too long."),
        ("wavs/empty_text.wav", "   \n"),
        ("wavs/silent.wav", "Nothing to hear."),
        ("wavs/zero.wav", "Zero bytes."),
        ("wavs/text.wav", "Not audio."),
        ("wavs/truncated.wav", "Half a wav."),
        ("wavs/truncated.flac", "Half a flac."),
        ("wavs/missing.wav", "Never written."),
    ]
    lines = [json.dumps({"audio": a, "text": t, "ref_audio": "wavs/good.wav"}) for a, t in entries]
    lines.append(json.dumps({"audio": "wavs/noref.wav", "text": "Bad ref.", "ref_audio": "wavs/gone.wav"}))
    lines.append(json.dumps({"audio": "wavs/dc.wav", "text": "Only an offset."}))
    lines.append(json.dumps({"audio": "wavs/antiphase.wav", "text": "Opposite phase."}))
    lines.append(json.dumps({"audio": "wavs/ref_text.wav", "text": "Ref is text.", "ref_audio": "wavs/text.wav"}))
    lines.append(json.dumps({"audio": "wavs/ref_silent.wav", "text": "Ref is mute.", "ref_audio": "wavs/silent.wav"}))
    lines.append(
        json.dumps(
            {"audio": "wavs/ref_long_silent.wav", "text": "A long mute ref.", "ref_audio": "wavs/silent_long.wav"}
        )
    )
    lines.append("{broken json")
    (root / "train.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root / "train.jsonl"


def test_every_rejection_reason_from_real_files_reaches_the_json_report(bad_dataset: Path, tmp_path: Path) -> None:
    manifest = load_manifest(bad_dataset, default_speaker="spk")
    report = validate_clips(manifest.records, CONFIG, manifest_rejections=manifest.rejected)

    assert [c.record.audio.name for c in report.accepted] == ["good.wav", "good2.flac"]
    by_source = {r.source: r for r in report.rejected}
    expected = {
        "train.jsonl:3": "duplicate",
        "train.jsonl:4": "duplicate",
        "train.jsonl:5": "too_short",
        "train.jsonl:6": "too_long",
        "train.jsonl:7": "empty_transcript",
        "train.jsonl:8": "silent",
        "train.jsonl:9": "unreadable_audio",
        "train.jsonl:10": "unreadable_audio",
        "train.jsonl:11": "unreadable_audio",
        "train.jsonl:12": "unreadable_audio",
        "train.jsonl:13": "missing_file",
        "train.jsonl:14": "missing_ref_audio",
        "train.jsonl:15": "silent",
        "train.jsonl:16": "silent",
        "train.jsonl:17": "unreadable_audio",
        "train.jsonl:18": "silent",
        "train.jsonl:19": "silent",  # a reference longer than max_duration is decoded all the same
        "train.jsonl:20": "malformed_entry",
    }
    assert {s: r.reason for s, r in by_source.items()} == expected
    assert "train.jsonl:1" in by_source["train.jsonl:3"].detail  # names the clip it duplicates
    assert "empty" in by_source["train.jsonl:9"].detail
    assert "truncated" in by_source["train.jsonl:11"].detail
    assert by_source["train.jsonl:13"].audio.endswith("missing.wav")
    assert by_source["train.jsonl:17"].detail.startswith(f"reference audio {bad_dataset.parent / 'wavs' / 'text.wav'}:")
    assert (
        by_source["train.jsonl:18"].detail.startswith("reference audio")
        and "dBFS" in by_source["train.jsonl:18"].detail
    )

    out = report.write_json(tmp_path / "reports" / "validation.json")
    saved = json.loads(out.read_text())
    assert saved["accepted"] == 2 and saved["rejected"] == len(expected)
    assert saved["total_accepted_seconds"] == pytest.approx(2.2, abs=1e-3)
    assert saved["speakers"] == {"spk": 2}
    assert {(r["source"], r["reason"]) for r in saved["rejections"]} == set(expected.items())
    assert all(set(r) == {"source", "audio", "reason", "detail"} for r in saved["rejections"])
    assert saved["rejection_reasons"]["unreadable_audio"] == 5
    assert [p.name for p in out.parent.iterdir()] == ["validation.json"]  # no temp file left behind

    summary = report.summary()
    assert "accepted 2 clips" in summary and "unreadable_audio: 5" in summary


def test_files_checked_ahead_in_shares_give_the_same_report(bad_dataset: Path, tmp_path: Path, monkeypatch) -> None:
    """The ranks of a run check their shares of the files (saved as JSON) and one validates with
    them: the report is the one a single process writes, and no file is read again."""
    manifest = load_manifest(bad_dataset, default_speaker="spk")
    loud = _write_variant(demo_dir() / "clips" / "alice" / "alice_001.flac", tmp_path / "loud.wav", gain_db=30.0)
    records = [*manifest.records, ClipRecord(loud, "She planted roses along the garden wall.", "spk", "x:1")]
    for config in (CONFIG, ValidationConfig(max_duration=3.0, clipped_action="flag")):
        files = files_to_check(records)
        assert len(files) == len(set(files)) and tmp_path / "missing.wav" not in files
        shares = [[[str(f), asdict(check_file(f, config))] for f in files[r::2]] for r in range(2)]
        checks = {Path(f): FileCheck(**c) for share in json.loads(json.dumps(shares)) for f, c in share}
        serial = validate_clips(records, config, manifest_rejections=manifest.rejected)
        long_ref = bad_dataset.parent / "wavs" / "silent_long.wav"  # past max_duration: decoded again as a reference

        def only_the_long_reference(path, cfg):
            assert path == long_ref and cfg.max_duration == math.inf, f"read again: {path}"
            return check_file(path, cfg)

        with monkeypatch.context() as m:
            m.setattr("tts_lightning.data.validation.check_file", only_the_long_reference)
            ahead = validate_clips(records, config, manifest_rejections=manifest.rejected, checks=checks)
        assert ahead.to_dict() == serial.to_dict() and ahead.accepted == serial.accepted
    assert [w.reason for w in ahead.warnings] == ["clipped"]


def test_accepted_clip_records_duration_and_content_hash(tmp_path: Path, write_tone) -> None:
    path = write_tone(tmp_path / "a.wav", sr=16_000, frames=20_000)
    rec = ClipRecord(audio=path, text="hi", speaker="s", source="m.jsonl:1")
    (clip,) = validate_clips([rec]).accepted
    assert clip.record is rec
    assert clip.duration == pytest.approx(1.25)
    assert clip.content_hash == hashlib.sha256(path.read_bytes()).hexdigest()


def test_thresholds_come_from_the_config(tmp_path: Path, write_tone) -> None:
    quiet = write_tone(tmp_path / "quiet.wav", seconds=1.0, amp=0.01)  # about -43 dBFS RMS
    rec = ClipRecord(audio=quiet, text="hi", speaker="s", source="x:1")
    assert len(validate_clips([rec], ValidationConfig(silence_threshold_db=-50)).accepted) == 1
    assert validate_clips([rec], ValidationConfig(silence_threshold_db=-40)).rejected[0].reason == "silent"
    assert validate_clips([rec], ValidationConfig(min_duration=1.5)).rejected[0].reason == "too_short"
    assert validate_clips([rec], ValidationConfig(max_duration=0.9)).rejected[0].reason == "too_long"


def test_raise_if_empty_names_manifest_and_top_reasons(bad_dataset: Path, tmp_path: Path) -> None:
    rec = ClipRecord(audio=tmp_path / "gone.wav", text="x", speaker="s", source="train.jsonl:1")
    report = validate_clips([rec, rec])
    with pytest.raises(ValueError, match=r"train\.jsonl.*missing_file x2"):
        report.raise_if_empty(bad_dataset)
    manifest = load_manifest(bad_dataset)
    validate_clips(manifest.records, CONFIG).raise_if_empty(bad_dataset)  # has accepted clips: no error


def _demo_records() -> list[ClipRecord]:
    return load_manifest(demo_dir() / "train.jsonl").records


def _write_variant(src: Path, dst: Path, *, gain_db: float = 0.0, speed: float = 1.0) -> Path:
    """A demo clip made louder (then clamped to full scale, as a clipping recorder does) or played
    faster/slower (resampled: `speed` 1.3 = 30% shorter), written as 16-bit wav."""
    wave, sr = sf.read(src, dtype="float32")
    x = torch.from_numpy(wave)
    if speed != 1.0:
        x = torchaudio.functional.resample(x, orig_freq=round(speed * 10), new_freq=10)
    x = (x * 10 ** (gain_db / 20)).clamp(-1.0, 1.0)
    dst.parent.mkdir(parents=True, exist_ok=True)
    sf.write(dst, x.numpy(), sr, subtype="PCM_16")
    return dst


def test_clipped_clip_is_rejected_or_flagged_and_normal_gain_is_accepted(tmp_path: Path) -> None:
    src = demo_dir() / "clips" / "alice" / "alice_001.flac"
    text = "She planted roses along the garden wall."
    normal = ClipRecord(_write_variant(src, tmp_path / "normal.wav"), text, "alice", "m:1")
    loud = ClipRecord(_write_variant(src, tmp_path / "loud.wav", gain_db=30.0), text, "alice", "m:2")

    report = validate_clips([normal, loud])
    assert [c.record.source for c in report.accepted] == ["m:1"] and report.warnings == []
    (rejection,) = report.rejected
    assert rejection.reason == "clipped" and rejection.source == "m:2" and "% of samples" in rejection.detail

    flagged = validate_clips([normal, loud], ValidationConfig(clipped_action="flag"))
    assert [c.record.source for c in flagged.accepted] == ["m:1", "m:2"] and flagged.rejected == []
    assert [(w.source, w.reason) for w in flagged.warnings] == [("m:2", "clipped")]
    saved = json.loads(flagged.write_json(tmp_path / "report.json").read_text())
    assert saved["flagged"] == 1 and saved["warning_reasons"] == {"clipped": 1}
    assert saved["warnings"][0]["source"] == "m:2" and saved["rejections"] == []
    assert "warnings: 1 accepted clip(s) flagged" in flagged.summary() and "clipped: 1" in flagged.summary()


def test_telephone_quality_audio_is_trained_on_and_flagged(tmp_path: Path) -> None:
    """8 kHz audio (a phone recording) holds nothing above 4 kHz: accepted, and named in the
    report's warnings; 16 kHz (LibriSpeech, many corpora) and above is not flagged."""
    src = demo_dir() / "clips" / "alice" / "alice_001.flac"
    wave, sr = sf.read(src, dtype="float32")
    text = "She planted roses along the garden wall."
    records = []
    for i, rate in enumerate((8_000, 16_000, sr), start=1):
        resampled = torchaudio.functional.resample(torch.from_numpy(wave), orig_freq=sr, new_freq=rate)
        sf.write(tmp_path / f"{rate}.wav", resampled.numpy(), rate, subtype="PCM_16")
        records.append(ClipRecord(tmp_path / f"{rate}.wav", text, "alice", f"m:{i}"))
    # A second 8 kHz clip whose transcript is far too long for it: rejected, so not among the warnings.
    quiet = torchaudio.functional.resample(0.5 * torch.from_numpy(wave), orig_freq=sr, new_freq=8_000)
    sf.write(tmp_path / "mismatch.wav", quiet.numpy(), 8_000, subtype="PCM_16")
    records.append(ClipRecord(tmp_path / "mismatch.wav", text * 20, "alice", "m:4"))
    report = validate_clips(records)
    assert [c.record.source for c in report.accepted] == ["m:1", "m:2", "m:3"]
    assert [(r.source, r.reason) for r in report.rejected] == [("m:4", "transcript_mismatch")]
    (warning,) = report.warnings
    assert (warning.source, warning.reason) == ("m:1", "low_sample_rate")
    assert warning.detail.startswith("recorded at 8000 Hz: it holds nothing above 4000 Hz")
    assert "low_sample_rate: 1" in report.summary()


def test_speaking_rate_rejects_a_mismatched_transcript_and_accepts_natural_speeds(tmp_path: Path) -> None:
    records = _demo_records()
    clips = demo_dir() / "clips" / "alice"
    five_sentences = " ".join(r.text for r in records[1:6])
    extra = [
        # The shortest alice clip (2.1 s) with five sentences of text.
        ClipRecord(_write_variant(clips / "alice_000.flac", tmp_path / "short.wav"), five_sentences, "alice", "x:1"),
        ClipRecord(
            _write_variant(clips / "alice_003.flac", tmp_path / "slow.wav", speed=0.8), records[3].text, "alice", "x:2"
        ),
        ClipRecord(
            _write_variant(clips / "alice_004.flac", tmp_path / "fast.wav", speed=1.3), records[4].text, "alice", "x:3"
        ),
    ]
    report = validate_clips(records + extra)
    assert len(report.accepted) == 24 + 2 and {c.record.source for c in report.accepted} >= {"x:2", "x:3"}
    (rejection,) = report.rejected
    assert (rejection.source, rejection.reason) == ("x:1", "transcript_mismatch")
    rate = float(rejection.detail.split(" chars/s")[0])
    assert 50 < rate < 150  # ~180 characters in ~1.8 s of speech
    assert "speaker 'alice' median 1" in rejection.detail  # about 15 chars/s

    flagged = validate_clips(records + extra, ValidationConfig(mismatch_action="flag"))
    assert len(flagged.accepted) == 27 and flagged.rejected == []
    assert [(w.source, w.reason) for w in flagged.warnings] == [("x:1", "transcript_mismatch")]

    # A tighter threshold catches the speed changes; a speaker with too few clips for statistics
    # still has the absolute limits.
    strict = validate_clips(records + extra[1:], ValidationConfig(max_rate_zscore=1.0))
    assert {r.source for r in strict.rejected} >= {"x:2", "x:3"}
    alone = validate_clips([ClipRecord(extra[0].audio, five_sentences, "carol", "x:1")])
    assert alone.rejected[0].reason == "transcript_mismatch" and "above the maximum" in alone.rejected[0].detail


def test_a_check_of_a_file_changed_since_is_done_again(tmp_path: Path, write_tone) -> None:
    """The ranks of a run check the files before the memo is written: a check of a file rewritten
    in between must not be remembered under the new file's size and time."""
    path = write_tone(tmp_path / "a.wav", seconds=1.0)
    stale = check_file(path, CONFIG)
    write_tone(path, seconds=2.0, freq=300)
    manifest = ManifestResult([ClipRecord(path, "Hello there.", "s", "m.jsonl:1")], [])
    report = validate_with_memo(manifest, CONFIG, tmp_path / "memo.json", checks={path: stale})
    assert report.accepted[0].duration == pytest.approx(2.0)
    assert report.accepted[0].content_hash == hashlib.sha256(path.read_bytes()).hexdigest()
