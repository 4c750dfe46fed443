"""Long recordings with subtitles: a ~2-minute recording made of the demo clips and silences, its
cues at the clip boundaries."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import soundfile as sf

from tts_lightning.data.codec_cache import SAMPLES_PER_FRAME
from tts_lightning.data.datamodule import SpeakerClipsDataModule
from tts_lightning.data.demo import demo_dir
from tts_lightning.data.manifest import load_manifest
from tts_lightning.data.subtitles import SubtitleError, cut_subtitled, merge_cues, parse_subtitles

SR = 24_000


def _stamp(seconds: float, sep: str = ",") -> str:
    ms = round(seconds * 1000)
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}{sep}{ms % 1000:03d}"


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    """talk.wav: the 24 demo clips (alice's, then bob's) with silences of 0.4 s after odd and 4.4 s
    after even clip numbers (about two minutes), and talk.srt: one cue per clip, "ALICE: ..." /
    "BOB: ...". Returns (folder, [(start, end) in samples])."""
    root = tmp_path_factory.mktemp("long")
    parts, bounds, cues = [np.zeros(SR // 2, dtype=np.int16)], [], []
    position = SR // 2
    for k, record in enumerate(load_manifest(demo_dir() / "train.jsonl").records):
        clip, sr = sf.read(record.audio, dtype="int16")
        assert sr == SR
        bounds.append((position, position + len(clip)))
        cues.append(
            f"{k + 1}\n{_stamp(position / SR)} --> {_stamp((position + len(clip)) / SR)}\n"
            f"{record.speaker.upper()}: {record.text}\n"
        )
        gap = np.zeros(int(SR * (0.4 if k % 2 else 4.4)), dtype=np.int16)
        parts += [clip, gap]
        position += len(clip) + len(gap)
    sf.write(root / "talk.wav", np.concatenate(parts), SR, subtype="PCM_16")
    (root / "talk.srt").write_text("\n".join(cues), encoding="utf-8")
    (root / "train.jsonl").write_text(json.dumps({"audio": "talk.wav", "speaker": "narrator"}) + "\n")
    return root, bounds


def test_cues_become_clips_at_the_cue_boundaries(recording, tmp_path):
    root, bounds = recording
    assert 100 < sf.info(root / "talk.wav").duration < 140  # about two minutes
    manifest = load_manifest(root / "train.jsonl")
    (record,) = manifest.records
    assert record.subtitles == root / "talk.srt" and record.text == ""

    cut, segments = cut_subtitled(manifest, tmp_path / "segments", target_seconds=0.0)
    assert len(cut.records) == len(segments) == 24 and cut.rejected == []
    whole, _ = sf.read(root / "talk.wav", dtype="int16")
    texts = [r.text for r in load_manifest(demo_dir() / "train.jsonl").records]
    for (start, end), seg, rec, text in zip(bounds, segments, cut.records, texts):
        assert abs(round(seg.start * SR) - start) < SAMPLES_PER_FRAME
        assert abs(round(seg.end * SR) - end) < SAMPLES_PER_FRAME
        clip, sr = sf.read(rec.audio, dtype="int16")
        assert sr == SR and np.array_equal(clip, whole[round(seg.start * SR) : round(seg.end * SR)])  # exact samples
        assert (rec.speaker, rec.text) == (seg.speaker, text) and seg.speaker in ("ALICE", "BOB")
        assert "talk.srt" not in rec.source and rec.source.startswith("train.jsonl:1 cue ")

    # A second run finds the cut clips and writes nothing.
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "segments").rglob("*")}
    again, _ = cut_subtitled(manifest, tmp_path / "segments", target_seconds=0.0)
    assert again.records == cut.records
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "segments").rglob("*")} == before


def test_short_cues_merge_up_to_the_target_but_never_across_a_speaker_change(recording, tmp_path):
    root, bounds = recording
    cues = parse_subtitles(root / "talk.srt")
    groups = merge_cues(cues, target_seconds=8.0)
    # Pairs across the short silences, except alice's last clip and bob's first: another speaker.
    assert groups == [[0]] + [[k, k + 1] for k in range(1, 10, 2)] + [[11], [12]] + [
        [k, k + 1] for k in range(13, 22, 2)
    ] + [[23]]
    assert all(cues[g[-1]].end - cues[g[0]].start <= 8.0 for g in groups)
    assert merge_cues(cues, target_seconds=0.0) == [[k] for k in range(24)]

    cut, segments = cut_subtitled(load_manifest(root / "train.jsonl"), tmp_path / "s", target_seconds=8.0)
    for group, seg in zip(groups, segments):  # merged clips start and end on cue boundaries
        assert abs(round(seg.start * SR) - bounds[group[0]][0]) < SAMPLES_PER_FRAME
        assert abs(round(seg.end * SR) - bounds[group[-1]][1]) < SAMPLES_PER_FRAME


def test_webvtt_voices_markup_and_errors_name_file_and_line(tmp_path):
    vtt = tmp_path / "a.vtt"
    vtt.write_text(
        "WEBVTT - a title\nKind: captions\nLanguage: en\n\nNOTE a comment\n\n"
        "00:00.500 --> 00:00.900\nbefore any label\n\n"
        "intro\n00:01.000 --> 00:02.500 align:start\n<v Dr. Who><i>Hello</i> there.\n\n"
        "00:00:03.000 --> 00:00:04.000\n<v.loud Rose>Run!</v>\n\n00:05.000 --> 00:06.000\nStill Rose.\n",
        encoding="utf-8",
    )
    cues = parse_subtitles(vtt)
    assert [(c.start, c.end, c.speaker, c.text) for c in cues] == [
        (0.5, 0.9, None, "before any label"),
        (1.0, 2.5, "Dr. Who", "Hello there."),
        (3.0, 4.0, "Rose", "Run!"),
        (5.0, 6.0, "Rose", "Still Rose."),  # an unlabelled cue continues the last speaker
    ]
    assert cues[1].line == 11
    bad = tmp_path / "b.srt"
    bad.write_text("1\n00:00:01,000 --> 00:00:02,000\nok\n\n2\n00:00:03,000 -> 00:00:04,000\nbroken\n")
    with pytest.raises(SubtitleError, match=r"b\.srt:5"):
        parse_subtitles(bad)


def test_prepare_validates_encodes_once_and_reports_the_segments(recording, tiny_dir, tmp_path):
    root, _ = recording
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addHandler(handler)
    try:
        for _ in range(2):
            data = SpeakerClipsDataModule(
                str(tiny_dir),
                str(root / "train.jsonl"),
                cache_dir=str(tmp_path / "cache"),
                subtitle_target_seconds=6.0,
                max_frames_per_batch=400,
            )
            assert data.speaker_names == ["ALICE", "BOB"]
            report = data.prepare()
    finally:
        logging.getLogger("lightning.pytorch.utilities.rank_zero").removeHandler(handler)
    saved = json.loads(data.report_path.read_text())
    assert saved["rejected"] == 0 and saved["accepted"] == len(saved["segments"]) == len(report.accepted)
    assert 14 <= len(saved["segments"]) < 24
    assert {s["speaker"] for s in saved["segments"]} == {"ALICE", "BOB"}
    assert all(s["recording"] == str(root / "talk.wav") for s in saved["segments"])
    encoded = [line for line in lines if line.startswith("codec cache:")]
    assert encoded[0].startswith(f"codec cache: {len(saved['segments'])} clip(s) encoded")
    assert encoded[1].startswith("codec cache: 0 clip(s) encoded")
    assert "cut 1 long recording(s) at their subtitles" in report.summary()
