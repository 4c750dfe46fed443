from __future__ import annotations

import json
from pathlib import Path

import pytest

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
    assert second.audio_codes == ((1,) * 16, (2,) * 16)
    hash(second)  # frozen records with tuple codes stay hashable


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
        (json.dumps({"audio": "a.wav", "text": "ok"}) + "\n" + '{"audio": "b.wav", "text": "Grüße"}\n').encode("cp1252")
    )
    with pytest.raises(ManifestEncodingError, match=r"train\.jsonl: line 2 .*0xfc"):
        load_manifest(manifest)
    assert load_manifest(manifest, encoding="cp1252").records[1].text == "Grüße"

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
