from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from tts_lightning.data.manifest import ClipRecord, load_manifest
from tts_lightning.data.validation import ValidationConfig, validate_clips

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
        "train.jsonl:15": "malformed_entry",
    }
    assert {s: r.reason for s, r in by_source.items()} == expected
    assert "train.jsonl:1" in by_source["train.jsonl:3"].detail  # names the clip it duplicates
    assert "empty" in by_source["train.jsonl:9"].detail
    assert "truncated" in by_source["train.jsonl:11"].detail
    assert by_source["train.jsonl:13"].audio.endswith("missing.wav")

    out = report.write_json(tmp_path / "reports" / "validation.json")
    saved = json.loads(out.read_text())
    assert saved["accepted"] == 2 and saved["rejected"] == len(expected)
    assert saved["total_accepted_seconds"] == pytest.approx(2.2, abs=1e-3)
    assert saved["speakers"] == {"spk": 2}
    assert {(r["source"], r["reason"]) for r in saved["rejections"]} == set(expected.items())
    assert all(set(r) == {"source", "audio", "reason", "detail"} for r in saved["rejections"])
    assert saved["rejection_reasons"]["unreadable_audio"] == 4
    assert [p.name for p in out.parent.iterdir()] == ["validation.json"]  # no temp file left behind

    summary = report.summary()
    assert "accepted 2 clips" in summary and "unreadable_audio: 4" in summary


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
