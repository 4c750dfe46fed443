from __future__ import annotations

import soundfile as sf

from tts_lightning.data.demo import demo_dir, demo_manifest
from tts_lightning.data.manifest import load_manifest
from tts_lightning.data.validation import validate_clips

MAX_BYTES = 2_000_000


def test_demo_is_small_and_in_the_expected_format() -> None:
    root = demo_dir()
    files = [p for p in root.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= MAX_BYTES
    flacs = sorted(p for p in files if p.suffix == ".flac")
    assert len(flacs) >= 24
    for path in flacs:
        info = sf.info(path)
        assert (info.samplerate, info.channels, info.subtype) == (24_000, 1, "PCM_16"), path
        assert 1.0 <= info.duration <= 4.0, path


def test_demo_loads_through_folder_and_jsonl_readers() -> None:
    folder = load_manifest(demo_dir() / "clips")
    jsonl = load_manifest(demo_manifest())
    assert folder.rejected == [] and jsonl.rejected == []
    assert {r.speaker for r in folder.records} == {r.speaker for r in jsonl.records} == {"alice", "bob"}
    # Both formats describe the same clips with the same transcripts and speakers.
    assert {(r.audio, r.text, r.speaker) for r in folder.records} == {
        (r.audio, r.text, r.speaker) for r in jsonl.records
    }
    assert all(r.language == "english" and r.ref_audio is not None for r in jsonl.records)
    assert {r.ref_audio.name for r in jsonl.records} == {"alice_000.flac", "bob_000.flac"}

    report = validate_clips(jsonl.records)
    assert report.rejected == []
    assert len(report.accepted) >= 20
    counts = report.speaker_counts()
    assert set(counts) == {"alice", "bob"} and min(counts.values()) >= 10
