"""Long recordings with subtitles: a ~2-minute recording made of the demo clips and silences, its
cues at the clip boundaries."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from tts_lightning.data.codec_cache import SAMPLES_PER_FRAME
from tts_lightning.data.datamodule import SpeakerClipsDataModule
from tts_lightning.data.demo import demo_dir
from tts_lightning.data.manifest import load_manifest
from tts_lightning.data.segments import cut_subtitled
from tts_lightning.data.subtitles import SubtitleError, merge_cues, parse_subtitles

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
    for group, seg in zip(groups, segments, strict=True):  # merged clips start and end on cue boundaries
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


def _write_recording(folder: Path, name: str, srt: str) -> None:
    """<name>.srt beside an existing <name>.<ext> recording, and train.jsonl listing them."""
    (folder / f"{name}.srt").write_text(srt, encoding="utf-8")
    audio = next(p.name for p in folder.iterdir() if p.stem == name and p.suffix != ".srt")
    with open(folder / "train.jsonl", "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"audio": audio, "speaker": "narrator"}) + "\n")


@pytest.mark.parametrize("ext", ["ogg", "mp3"])
def test_lossy_recordings_are_cut_at_exactly_the_samples_they_decode_to(ext, make_sine, tmp_path):
    # The soundfile wheel's libsndfile (>= 1.1) writes and reads MP3 and Ogg Vorbis.
    n = 3 * SR
    sf.write(tmp_path / f"talk.{ext}", make_sine(None, SR, frames=n) * np.linspace(0.2, 1.0, n), SR)
    spans = [(0.1, 0.9), (1.0, 1.8), (1.5, 2.3), (2.4, 2.9)]  # the 2nd and 3rd overlap
    _write_recording(
        tmp_path,
        "talk",
        "\n".join(f"{k}\n{_stamp(a)} --> {_stamp(b)}\nWords {k}.\n" for k, (a, b) in enumerate(spans, 1)),
    )
    cut, segments = cut_subtitled(load_manifest(tmp_path / "train.jsonl"), tmp_path / "s", target_seconds=0.0)
    assert cut.rejected == [] and len(segments) == 4
    whole, _ = sf.read(tmp_path / f"talk.{ext}", dtype="float32")  # decoded in one read: the reference
    for (a, b), seg in zip(spans, segments):
        clip, sr = sf.read(seg.audio, dtype="float32")
        assert sr == SR and sf.info(seg.audio).subtype == "FLOAT"
        assert np.array_equal(clip, whole[round(a * SR) : round(b * SR)])


def test_a_bad_cue_is_rejected_alone_naming_file_and_line(write_tone, tmp_path):
    write_tone(tmp_path / "talk.wav", seconds=3.0)
    write_tone(tmp_path / "none.wav", seconds=1.0)
    _write_recording(
        tmp_path,
        "talk",
        "1\n00:00:00,100 --> 00:00:00,600\nJOHN: Good cue.\n\n"
        "2\n00:00:00,700 --> 00:00:00,700\nZero length.\n\n"
        "3\n00:00:00,800 --> 00:00:01,400\nFirst line,\n\nafter a blank line.\n\n"
        "4\n00:00:01,500 -> 00:00:01,900\nBroken timing.\n\n"
        "5\n00:00:02,000 --> 00:00:02,500\n- JOHN: Hi there.\n- MARY: Hello.\n\n"
        "6\n00:00:02,600 --> 00:00:03,500\nRuns past the end.\n\n"
        "7\n00:00:04,000 --> 00:00:05,000\nAfter the end.\n",
    )
    _write_recording(tmp_path, "none", "1\n00:00:00,500 --> 00:00:00,200\nBackwards.\n")
    cut, segments = cut_subtitled(load_manifest(tmp_path / "train.jsonl"), tmp_path / "s", target_seconds=0.0)
    assert [(r.speaker, r.text) for r in cut.records[:2]] == [
        ("JOHN", "Good cue."),
        ("JOHN", "First line, after a blank line."),
    ]
    assert [s.cues for s in segments] == ["1", "3", "6"] and (segments[2].start, segments[2].end) == (2.6, 3.0)
    talk, none = tmp_path / "talk.srt", tmp_path / "none.srt"
    # Cues 1 and 3 are never merged: the audio of cue 2 between them would be in the clip, its text not.
    assert merge_cues(parse_subtitles(talk, problems=[]), target_seconds=10.0)[:2] == [[0], [1]]
    assert [(r.source, r.reason, r.detail) for r in cut.rejected] == [
        ("train.jsonl:1", "malformed_entry", f"{talk}:6: cue 2 has zero length (starts and ends at 0.700 s)"),
        (
            "train.jsonl:1",
            "malformed_entry",
            f"{talk}:15: cue 4: expected a cue timing 'HH:MM:SS,mmm --> HH:MM:SS,mmm'",
        ),
        (
            "train.jsonl:1",
            "malformed_entry",
            f"{talk}:20: cue 5: lines by 2 speakers (JOHN, MARY) in one cue, which cannot be cut apart",
        ),
        (
            "train.jsonl:1",
            "malformed_entry",
            f"{talk}:29: cue 7 starts at 4.000 s, after the end of the recording (3.000 s)",
        ),
        ("train.jsonl:2", "malformed_entry", f"{none}:2: cue 1 ends (0.200 s) before it starts (0.500 s)"),
        ("train.jsonl:2", "malformed_entry", f"{none}: no usable cue"),
    ]
    # The rejections cut once are kept with the cut: a second run reports them as well.
    assert cut_subtitled(load_manifest(tmp_path / "train.jsonl"), tmp_path / "s", target_seconds=0.0)[0] == cut


def test_a_cue_longer_than_max_duration_is_rejected_uncut_and_merging_stops_below_it(write_tone, tmp_path):
    write_tone(tmp_path / "talk.wav", seconds=3.0)
    _write_recording(
        tmp_path,
        "talk",
        "1\n00:00:00,100 --> 00:00:00,700\nOne.\n\n"
        "2\n00:00:00,800 --> 00:00:01,300\nTwo.\n\n"
        "3\n00:00:01,400 --> 02:00:01,400\nA typo in the hours.\n",
    )
    manifest = load_manifest(tmp_path / "train.jsonl")
    cut, segments = cut_subtitled(manifest, tmp_path / "s", target_seconds=10.0, max_duration=1.0)
    assert [s.cues for s in segments] == ["1", "2"]  # 1 and 2 together would last 1.2 s
    assert [(r.reason, r.detail) for r in cut.rejected] == [
        (
            "too_long",
            f"{tmp_path / 'talk.srt'}:10: cue 3 (1.400 s to 7201.400 s) lasts 1.600 s in the recording, longer "
            "than max_duration 1.0 s",
        )
    ]
    assert sorted(p.name for p in (tmp_path / "s").rglob("*.wav")) == ["talk_0001.wav", "talk_0002.wav"]
    # The rejection is kept with the cut; without the limit the cues merge and cue 3 is cut to the end.
    assert cut_subtitled(manifest, tmp_path / "s", target_seconds=10.0, max_duration=1.0)[0] == cut
    _, unlimited = cut_subtitled(manifest, tmp_path / "s", target_seconds=10.0)
    assert [(s.cues, s.end) for s in unlimited] == [("1-2", 1.3), ("3", 3.0)]


def test_markup_entities_and_speaker_labels(tmp_path):
    srt = tmp_path / "a.srt"
    srt.write_text(
        "1\n00:00:01,000 --> 00:00:02,000\n<i>5 < 10 and 10 > 5 today</i>\n\n"
        "2\n00:00:02,000 --> 00:00:03,000\nNOTE: bring the keys.\n\n"
        "3\n00:00:03,000 --> 00:00:04,000\n- JOHN: Hi there.\n- JOHN: It's me.\n\n"
        "4\n00:00:04,000 --> 00:00:05,000\n- Hi.\n- Hello.\n\n"
        '5\n00:00:05,000 --> 00:00:06,000\n{\\an8}<font color="#ffff00">Tom &amp; Jerry</font>\n\n'
        "6\n00:00:06,000 --> 00:00:07,000\n- JOHN: Hi there.\n- MARY: Hello.\n\n"
        "7\n00:00:07,000 --> 00:00:08,000\nBOB:\n<i>A label on a line of its own.</i>\n",
        encoding="utf-8",
    )
    problems: list[SubtitleError] = []
    assert [(c.text, c.speaker) for c in parse_subtitles(srt, problems=problems)] == [
        ("5 < 10 and 10 > 5 today", None),
        ("NOTE: bring the keys.", None),  # a label word, not a speaker
        ("Hi there. It's me.", "JOHN"),
        ("Hi. Hello.", "JOHN"),  # unlabelled dialogue: one text, the speaker continues
        ("Tom & Jerry", "JOHN"),
        ("A label on a line of its own.", "BOB"),
    ]
    assert [str(p) for p in problems] == [
        f"{srt}:24: cue 6: lines by 2 speakers (JOHN, MARY) in one cue, which cannot be cut apart"
    ]
    with pytest.raises(SubtitleError, match=r"a\.srt:24: cue 6"):
        parse_subtitles(srt)
    numbered = tmp_path / "n.srt"  # a cue number separated from its timing by a blank line
    numbered.write_text("1\n00:00:01,000 --> 00:00:02,000\nHello there.\n\n2\n\n00:00:02,000 --> 00:00:03,000\nBye.\n")
    assert [c.text for c in parse_subtitles(numbered)] == ["Hello there.", "Bye."]
    vtt = tmp_path / "a.vtt"
    vtt.write_text(
        "WEBVTT\n\n00:01.000 --> 00:02.000\nTom &amp; Jerry &lt;3 &nbsp;ok\n\n"
        "00:02.000 --> 00:03.000\n<c.yellow>Look</c> <00:02.500>at <lang en>this</lang>, <b>now</b>.\n\n"
        "00:03.000 --> 00:04.000\nMARY: in WebVTT only a voice tag names the speaker.\n",
        encoding="utf-8",
    )
    assert [(c.text, c.speaker) for c in parse_subtitles(vtt)] == [
        ("Tom & Jerry <3 ok", None),
        ("Look at this, now.", None),
        ("MARY: in WebVTT only a voice tag names the speaker.", None),
    ]


_TWO_CUES = "1\n00:00:00,100 --> 00:00:00,900\nOne.\n\n2\n00:00:01,000 --> 00:00:01,900\nTwo.\n"


@pytest.fixture
def two_recordings(write_tone, tmp_path):
    """a.wav and b.wav (2 s), each with the subtitles `_TWO_CUES`; returns their train.jsonl."""
    for name in ("a", "b"):
        write_tone(tmp_path / f"{name}.wav", seconds=2.0)
        _write_recording(tmp_path, name, _TWO_CUES)
    return tmp_path / "train.jsonl"


def test_a_deleted_clip_is_cut_again(two_recordings, tmp_path):
    manifest = load_manifest(two_recordings)
    cut, segments = cut_subtitled(manifest, tmp_path / "segments", target_seconds=0.0)
    clip = Path(segments[1].audio)
    data = clip.read_bytes()
    clip.unlink()
    assert cut_subtitled(manifest, tmp_path / "segments", target_seconds=0.0)[0] == cut
    assert clip.read_bytes() == data


def test_an_edited_srt_leaves_no_old_cut_behind(two_recordings, tmp_path):
    segments_dir = tmp_path / "segments"
    _, segments = cut_subtitled(load_manifest(two_recordings), segments_dir, target_seconds=0.0)
    a_folder, b_folder = Path(segments[0].audio).parent, Path(segments[2].audio).parent
    (tmp_path / "a.srt").write_text(_TWO_CUES.replace("Two.", "Two, edited."), encoding="utf-8")
    edited, segments = cut_subtitled(load_manifest(two_recordings), segments_dir, target_seconds=0.0)
    assert [r.text for r in edited.records] == ["One.", "Two, edited.", "One.", "Two."]
    # a's earlier cut is gone; b's (another recording's) is kept.
    assert sorted(segments_dir.iterdir()) == sorted({Path(segments[0].audio).parent, b_folder})
    assert Path(segments[0].audio).parent != a_folder
    # A cut of the same files with other settings (another run's, perhaps being read) is kept.
    _, merged = cut_subtitled(load_manifest(two_recordings), segments_dir, target_seconds=10.0)
    assert {Path(seg.audio).parent for seg in segments + merged} == set(segments_dir.iterdir())
    assert len(list(segments_dir.iterdir())) == 4
    # A cut by an earlier version of the cutter (no version in its segments.json) is removed.
    old = b_folder.with_name(b_folder.name.split("-")[0] + "-" + "0" * 20)
    shutil.copytree(b_folder, old)
    index = json.loads((old / "segments.json").read_text())
    del index["version"]
    (old / "segments.json").write_text(json.dumps(index))
    Path(segments[3].audio).unlink()  # b is cut again
    cut_subtitled(load_manifest(two_recordings), segments_dir, target_seconds=0.0)
    assert not old.exists() and len(list(segments_dir.iterdir())) == 4


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
