from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from tts_lightning.data.audio import read_audio
from tts_lightning.data.cache_folder import CACHEDIR_TAG, write_cachedir_tag
from tts_lightning.data.manifest import ClipRecord, ManifestEncodingError, load_manifest


def _jsonl(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_jsonl_resolves_relative_paths_and_keeps_fields(tmp_path: Path) -> None:
    abs_audio = tmp_path / "elsewhere" / "abs.wav"
    manifest = _jsonl(
        tmp_path / "data" / "train.jsonl",
        [
            json.dumps({"audio": "wavs/a.wav", "text": "Hello there.", "ref_audio": "ref.wav"}),
            json.dumps(
                {
                    "audio": str(abs_audio),
                    "text": "Second.",
                    "ref_audio": "../ref2.wav",
                    "speaker": "alice",
                    "language": "english",
                    "audio_codes": [[1] * 16, [2] * 16],
                }
            ),
        ],
    )
    result = load_manifest(manifest, default_speaker="narrator")
    assert result.rejected == []
    first, second = result.records
    assert first == ClipRecord(
        audio=tmp_path / "data" / "wavs" / "a.wav",
        text="Hello there.",
        speaker="narrator",
        source="train.jsonl:1",
        ref_audio=tmp_path / "data" / "ref.wav",
    )
    assert first.language == "auto" and first.audio_codes is None
    assert second.audio == abs_audio
    assert second.ref_audio == tmp_path / "ref2.wav"  # ".." normalised away
    assert (second.speaker, second.language, second.source) == ("alice", "english", "train.jsonl:2")
    assert second.audio_codes is not None and len(second.audio_codes) == 2
    assert np.asarray(second.audio_codes).tolist() == [[1] * 16, [2] * 16]
    hash(second)  # frozen records with their codes stay hashable


def test_jsonl_malformed_lines_become_rejections_with_line_numbers(tmp_path: Path) -> None:
    manifest = _jsonl(
        tmp_path / "train.jsonl",
        [
            json.dumps({"audio": "a.wav", "text": "ok"}),
            "",  # blank line: skipped, still counted for line numbers
            "{not json",
            json.dumps({"audio": "b.wav"}),
            json.dumps({"text": "no audio"}),
            json.dumps(["a", "list"]),
            json.dumps({"audio": "c.wav", "text": "bad codes", "audio_codes": [[1, 2], [3]]}),
            json.dumps({"audio": "d.wav", "text": "fine too"}),
        ],
    )
    result = load_manifest(manifest)
    assert [r.source for r in result.records] == ["train.jsonl:1", "train.jsonl:8"]
    bad = {r.source: r for r in result.rejected}
    assert set(bad) == {"train.jsonl:3", "train.jsonl:4", "train.jsonl:5", "train.jsonl:6", "train.jsonl:7"}
    assert all(r.reason == "malformed_entry" for r in result.rejected)
    assert "invalid JSON" in bad["train.jsonl:3"].detail
    assert "'text'" in bad["train.jsonl:4"].detail and bad["train.jsonl:4"].audio == "b.wav"
    assert "'audio'" in bad["train.jsonl:5"].detail
    assert "widths" in bad["train.jsonl:7"].detail


def test_ljspeech_header_row_is_not_a_clip(tmp_path: Path) -> None:
    root = tmp_path / "LJ"
    (root / "wavs").mkdir(parents=True)
    (root / "metadata.csv").write_text("id|text|normalized\nLJ001|Hello.|Hello.\nfile|A clip named file.\n")
    result = load_manifest(root / "metadata.csv")
    # The header (line 1) is skipped; a later row with a header-like id is a clip like any other.
    assert [(r.audio.name, r.text) for r in result.records] == [
        ("LJ001.wav", "Hello."),
        ("file.wav", "A clip named file."),
    ]
    assert result.rejected == []


def test_ljspeech_two_and_three_columns(tmp_path: Path) -> None:
    root = tmp_path / "LJ"
    root.mkdir()
    (root / "metadata.csv").write_text(
        "LJ001|Mr. Smith paid $5.|Mister Smith paid five dollars.\n"
        "LJ002|Two columns only\n"
        "LJ003|Empty normalised falls back|\n"
        "LJ004|too|many|columns\n"
        "just-one-column\n"
        '|no id "quoted|x\n',
        encoding="utf-8",
    )
    result = load_manifest(root / "metadata.csv", default_speaker="lj")
    texts = {r.audio.name: r.text for r in result.records}
    assert texts == {
        "LJ001.wav": "Mister Smith paid five dollars.",
        "LJ002.wav": "Two columns only",
        "LJ003.wav": "Empty normalised falls back",
    }
    assert all(r.audio.parent == root / "wavs" and r.speaker == "lj" for r in result.records)
    assert [r.source for r in result.records] == ["metadata.csv:1", "metadata.csv:2", "metadata.csv:3"]
    assert [(r.source, r.reason) for r in result.rejected] == [
        ("metadata.csv:4", "malformed_entry"),
        ("metadata.csv:5", "malformed_entry"),
        ("metadata.csv:6", "malformed_entry"),
    ]
    assert "got 4" in result.rejected[0].detail
    # A dataset root holding metadata.csv is read the same way.
    assert load_manifest(root, default_speaker="lj").records == result.records


def test_folder_with_speaker_subfolders(tmp_path: Path, write_tone) -> None:
    root = tmp_path / "clips"
    for rel, text in [("root_clip.wav", "at the root"), ("alice/a1.flac", "alice one"), ("bob/b1.WAV", " bob one \n")]:
        write_tone(root / rel)
        (root / rel).with_suffix(".txt").write_text(text, encoding="utf-8")
    write_tone(root / "bob" / "untranscribed.wav")
    (root / "bob" / "notes.md").write_text("not audio")
    write_tone(root / ".hidden" / "x.wav")

    result = load_manifest(root, default_speaker="me")
    got = {(r.source, r.speaker, r.text) for r in result.records}
    assert got == {
        ("root_clip.wav", "me", "at the root"),
        ("alice/a1.flac", "alice", "alice one"),
        ("bob/b1.WAV", "bob", "bob one"),
    }
    assert all(r.audio.is_absolute() and r.audio.is_file() for r in result.records)
    assert [(r.source, r.reason) for r in result.rejected] == [("bob/untranscribed.wav", "no_transcript")]
    assert "untranscribed.txt" in result.rejected[0].detail


def test_missing_and_unknown_manifests_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_manifest(missing)
    odd = tmp_path / "list.yaml"
    odd.write_text("a: 1")
    with pytest.raises(ValueError, match="list.yaml"):
        load_manifest(odd)


def test_latin1_metadata_names_file_line_and_byte_and_loads_with_the_encoding(tmp_path: Path) -> None:
    root = tmp_path / "LJ"
    root.mkdir()
    (root / "metadata.csv").write_bytes("LJ001|Plain ASCII.\nLJ002|Un café crème.\n".encode("latin-1"))
    with pytest.raises(ManifestEncodingError) as caught:
        load_manifest(root)
    message = str(caught.value)
    offset = len("LJ001|Plain ASCII.\nLJ002|Un caf")
    assert str(root / "metadata.csv") in message
    assert "line 2" in message and f"byte 0xe9 at byte offset {offset}" in message
    assert "UTF-8" in message and "manifest_encoding" in message
    assert (caught.value.line, caught.value.byte) == (2, 0xE9)

    result = load_manifest(root, encoding="latin-1")
    assert [r.text for r in result.records] == ["Plain ASCII.", "Un café crème."]
    with pytest.raises(ValueError, match="unknown manifest encoding 'klingon'"):
        load_manifest(root, encoding="klingon")


def test_jsonl_and_transcripts_in_another_encoding(tmp_path: Path, write_tone) -> None:
    manifest = tmp_path / "train.jsonl"
    manifest.write_bytes(
        (json.dumps({"audio": "a.wav", "text": "ok"}) + "\n" + '{"audio": "b.wav", "text": "“Grüße” – bye"}\n').encode(
            "cp1252"
        )
    )
    # A file saved on Windows: the advice is cp1252 (latin-1 reads its quotes and dash as control characters).
    with pytest.raises(ManifestEncodingError, match=r"train\.jsonl: line 2 .*0x93.*manifest_encoding cp1252"):
        load_manifest(manifest)
    assert load_manifest(manifest, encoding="cp1252").records[1].text == "“Grüße” – bye"

    # A folder: a transcript that is not UTF-8 is a rejection naming its file, line and byte.
    write_tone(tmp_path / "clips" / "x.wav")
    (tmp_path / "clips" / "x.txt").write_bytes("Ça va.".encode("latin-1"))
    (rejection,) = load_manifest(tmp_path / "clips").rejected
    assert rejection.reason == "malformed_entry" and "x.txt: line 1" in rejection.detail and "0xc7" in rejection.detail
    assert load_manifest(tmp_path / "clips", encoding="latin-1").records[0].text == "Ça va."


def test_ljspeech_quoted_fields_and_stray_columns(tmp_path: Path) -> None:
    csv_path = tmp_path / "metadata.csv"
    csv_path.write_text(
        'LJ001|"A pipe | inside quotes"|"Normalised | too"\nLJ002|text|normalized|\nLJ003|"broken"quote|x|y\n',
        encoding="utf-8",
    )
    result = load_manifest(csv_path)
    assert [r.text for r in result.records] == ["Normalised | too"]
    stray, broken = result.rejected
    assert stray.source == "metadata.csv:2" and "stray '|' at the end" in stray.detail
    assert str(csv_path) + ":2" in stray.detail
    assert broken.source == "metadata.csv:3" and "metadata.csv:3" in broken.detail


def test_ljspeech_quoted_field_with_one_pipe_and_unbalanced_quotes(tmp_path: Path) -> None:
    csv_path = tmp_path / "metadata.csv"
    csv_path.write_text(
        'LJ001|"She said | hello"\n'  # 3 plain columns, 2 quoted ones
        'LJ002| "Spaced | quote"|\n'
        'LJ003|He said "hi|He said "hi\n'  # LJSpeech's own unbalanced quotes stay text
        'LJ004|"Hello," she said.|"Hello," she said.\n'
        'LJ005|"open quote\n'
        'LJ006|"Hello world"|"Hello world"\n'  # quotes around no '|': the text's own
        'LJ007|"a | b" \n',  # a space after the closing quote
        encoding="utf-8",
    )
    result = load_manifest(csv_path)
    assert result.rejected == []
    assert [r.text for r in result.records] == [
        "She said | hello",
        "Spaced | quote",
        'He said "hi',
        '"Hello," she said.',
        '"open quote',
        '"Hello world"',
        "a | b",
    ]


def test_whitespace_runs_in_transcripts_become_one_space(tmp_path: Path, write_tone) -> None:
    write_tone(tmp_path / "clips" / "a.wav")
    (tmp_path / "clips" / "a.txt").write_bytes(b"The morning train\r\nwas late   again.\r\n")
    assert load_manifest(tmp_path / "clips").records[0].text == "The morning train was late again."
    (tmp_path / "metadata.csv").write_text("LJ001|x|The morning\ttrain  was late.\n", encoding="utf-8")
    assert load_manifest(tmp_path / "metadata.csv").records[0].text == "The morning train was late."
    manifest = _jsonl(tmp_path / "train.jsonl", [json.dumps({"audio": "a.wav", "text": " Two\nlines. "})])
    assert load_manifest(manifest).records[0].text == "Two lines."


def test_jsonl_null_speaker_and_language_are_absent(tmp_path: Path) -> None:
    # pandas' to_json writes missing values as null.
    manifest = _jsonl(
        tmp_path / "train.jsonl",
        [json.dumps({"audio": "a.wav", "text": "Hi.", "ref_audio": None, "speaker": None, "language": None})],
    )
    result = load_manifest(manifest, default_speaker="narrator")
    assert result.rejected == []
    assert [(r.speaker, r.language) for r in result.records] == [("narrator", "auto")]


def test_folder_reports_orphan_transcripts_and_unsupported_audio(tmp_path: Path, write_tone) -> None:
    root = tmp_path / "clips"
    write_tone(root / "a1.wav")
    (root / "a1.txt").write_text("one", encoding="utf-8")
    write_tone(root / "long.wav")
    (root / "long.srt").write_text("1\n00:00:00,000 --> 00:00:01,000\nHi.\n", encoding="utf-8")
    (root / "orphan.txt").write_text("no audio", encoding="utf-8")
    (root / "alice" / "a5.m4a").parent.mkdir()
    (root / "alice" / "a5.m4a").write_bytes(b"\x00\x00\x00\x20ftypM4A ")
    (root / "alice" / "a5.txt").write_text("a format we do not read", encoding="utf-8")
    (root / "._a1.txt").write_bytes(b"\x00\x05\x16\x07")  # macOS metadata: skipped
    write_tone(root / "B2.WAV")
    (root / "B2.TXT").write_text("upper-case names", encoding="utf-8")
    write_tone(root / "a1.ogg")  # the same utterance as a1.wav, sharing a1.txt: the lossless one is kept
    write_tone(root / "long.mp3.wav")  # another stem: its own clip (no transcript)
    write_tone(root / "x.wav")
    write_tone(root / "x.flac")  # neither has a transcript: two missing transcripts, not duplicates

    result = load_manifest(root)
    assert [r.source for r in result.records] == ["B2.WAV", "a1.wav", "long.wav"]
    assert [(r.source, r.reason) for r in result.rejected] == [
        ("a1.ogg", "duplicate"),
        ("alice/a5.m4a", "unreadable_audio"),
        ("long.mp3.wav", "no_transcript"),
        ("orphan.txt", "missing_file"),
        ("x.flac", "no_transcript"),
        ("x.wav", "no_transcript"),
    ]
    shared = result.rejected[0]
    assert shared.detail.startswith("a1.ogg shares a1.txt with a1.wav, which is trained") and shared.audio == str(
        root / "a1.ogg"
    )
    unsupported, orphan = result.rejected[1], result.rejected[3]
    assert ".m4a" in unsupported.detail and "not supported" in unsupported.detail and ".wav" in unsupported.detail
    assert unsupported.audio == str(root / "alice" / "a5.m4a")
    assert "orphan.txt has no audio file" in orphan.detail and ".flac" in orphan.detail


@pytest.mark.parametrize(
    ("name", "fmt", "subtype", "sr"),
    [
        ("clip.aif", "AIFF", "PCM_16", 24_000),
        ("clip.aiff", "AIFF", "PCM_16", 24_000),
        ("clip.opus", "OGG", "OPUS", 48_000),  # the soundfile wheel's libsndfile (>= 1.0.29) has Opus
    ],
)
def test_folder_reads_opus_and_aiff(tmp_path: Path, make_sine, name: str, fmt: str, subtype: str, sr: int) -> None:
    path = tmp_path / name
    sf.write(path, make_sine(1.0, sr), sr, format=fmt, subtype=subtype)
    path.with_suffix(".txt").write_text("hello", encoding="utf-8")
    result = load_manifest(tmp_path)
    assert result.rejected == [] and [r.audio for r in result.records] == [path]
    wave, rate = read_audio(path)  # the reader the pipeline decodes with
    assert rate == sr and wave.shape == (1, sr)


def test_folder_skips_tagged_cache_folders(tmp_path: Path, write_tone) -> None:
    root = tmp_path / "clips"
    write_tone(root / "a1.wav")
    (root / "a1.txt").write_text("one", encoding="utf-8")
    write_cachedir_tag(root / "cache")
    write_cachedir_tag(root / "cache")  # already there: kept
    assert (root / "cache" / "CACHEDIR.TAG").read_text() == CACHEDIR_TAG
    write_tone(root / "cache" / "segments" / "cut.wav")  # cut clips have no transcripts
    (root / "cache" / "stray.txt").write_text("x", encoding="utf-8")
    # A CACHEDIR.TAG without the spec's signature does not mark a cache.
    write_tone(root / "bob" / "b1.wav")
    (root / "bob" / "b1.txt").write_text("bob", encoding="utf-8")
    (root / "bob" / "CACHEDIR.TAG").write_text("not a tag", encoding="utf-8")

    result = load_manifest(root)
    assert [r.source for r in result.records] == ["a1.wav", "bob/b1.wav"]
    assert result.rejected == []
