"""Read training manifests (Qwen3-TTS JSONL, LJSpeech metadata.csv, folder of clips) into ClipRecords.

Malformed entries never stop a run: each one becomes a Rejection carrying the
manifest location ("train.jsonl:12") so the user can fix it later.

Every reader collapses each run of whitespace in a transcript (newlines, tabs, repeated spaces) to one
space: inside one transcript such a run is never meaningful for TTS training.
"""

from __future__ import annotations

import codecs
import csv
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf

from tts_lightning.data.cache_folder import is_cache_dir

# What soundfile (libsndfile) decodes; Opus only where this libsndfile build has it (>= 1.0.29).
_OPUS = {".opus"} if "OPUS" in sf.available_subtypes("OGG") else set()
AUDIO_EXTENSIONS: frozenset[str] = frozenset({".wav", ".flac", ".ogg", ".mp3", ".aif", ".aiff", *_OPUS})
# Common audio formats soundfile cannot decode: a folder manifest reports them instead of skipping them.
_UNSUPPORTED_AUDIO_EXTENSIONS = (
    frozenset({".m4a", ".m4b", ".aac", ".mp4", ".wma", ".webm", ".mka", ".amr", ".3gp", ".ape", ".wv", ".opus"})
    - AUDIO_EXTENSIONS
)
SUBTITLE_EXTENSIONS = (".srt", ".vtt")
_LOSSLESS = frozenset({".wav", ".flac", ".aif", ".aiff"})
_SUPPORTED_LIST = "/".join(sorted(AUDIO_EXTENSIONS))

DEFAULT_ENCODING = "utf-8"


class ManifestEncodingError(ValueError):
    """A manifest (or transcript) file is not text in the expected encoding."""

    def __init__(self, path: Path, encoding: str, line: int, column: int, offset: int, byte: int) -> None:
        self.path, self.encoding, self.line, self.column, self.offset, self.byte = (
            path,
            encoding,
            line,
            column,
            offset,
            byte,
        )
        super().__init__(
            f"{path}: line {line} is not valid {encoding}: byte 0x{byte:02x} at byte offset {offset} "
            f"(byte {column} of the line). Re-save the file as UTF-8, or pass its encoding "
            f"(manifest_encoding, e.g. --data.manifest_encoding cp1252 for a file saved on Windows)"
        )


def read_text(path: str | os.PathLike, encoding: str | None = None) -> str:
    """A text file decoded with ``encoding`` (default UTF-8; a UTF-8 byte-order mark is dropped).

    Raises `ManifestEncodingError` naming the file, the line and the offending byte when the
    bytes are not valid in that encoding, and ValueError for an unknown encoding name.
    """
    path = Path(path)
    encoding = encoding or DEFAULT_ENCODING
    try:
        name = codecs.lookup(encoding).name
    except LookupError:
        raise ValueError(f"unknown manifest encoding {encoding!r} (for {path})") from None
    data = path.read_bytes()
    if name == "utf-8":
        name = "utf-8-sig"
    try:
        return data.decode(name)
    except UnicodeDecodeError as exc:
        line_start = data.rfind(b"\n", 0, exc.start) + 1
        raise ManifestEncodingError(
            path,
            encoding,
            data.count(b"\n", 0, exc.start) + 1,
            exc.start - line_start + 1,
            exc.start,
            data[exc.start],
        ) from None


@dataclass(frozen=True)
class ManifestCodes:
    """Codec codes a manifest carries (frames x groups) as int32 bytes: hashable like the record,
    ~8 KB for a 10 s clip, where nested tuples of Python ints took ~87 KB (1.7 GB per process for
    20,000 clips, and every rank reads the manifest several times as it starts)."""

    data: bytes
    shape: tuple[int, int]

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        codes = np.frombuffer(self.data, dtype=np.int32).reshape(self.shape)
        return codes if dtype is None else codes.astype(dtype)


@dataclass(frozen=True)
class ClipRecord:
    """One training clip as described by a manifest (nothing checked on disk yet)."""

    audio: Path  # absolute
    text: str
    speaker: str
    source: str  # manifest location for error messages, e.g. "train.jsonl:12"
    ref_audio: Path | None = None  # absolute when given
    language: str = "auto"
    # Pre-computed codec codes (T x 16) from a prepared JSONL.
    audio_codes: ManifestCodes | None = None
    # A long recording to cut at these subtitles' cues (tts_lightning.data.segments); text is empty.
    subtitles: Path | None = None
    # A style instruction, laid out as generate_custom_voice(instruct=...) does (custom_voice models).
    instruct: str = ""


@dataclass(frozen=True)
class Rejection:
    """A manifest entry or clip that will not be trained on, and why."""

    source: str
    audio: str | None
    reason: str  # a code ("malformed_entry", "missing_file", "too_short", ...), what the summary counts
    detail: str


@dataclass
class ManifestResult:
    records: list[ClipRecord]
    rejected: list[Rejection]


def subtitles_for(audio: Path) -> Path | None:
    """The ``.srt`` / ``.vtt`` file beside ``audio`` with the same stem, if any."""
    for ext in SUBTITLE_EXTENSIONS:
        for candidate in (audio.with_suffix(ext), audio.with_suffix(ext.upper())):
            if candidate.is_file():
                return candidate
    return None


def _clean_text(text: str) -> str:
    """``text`` with every whitespace run (\\r\\n, tabs, repeated spaces) made one space, ends stripped."""
    return " ".join(text.split())


def _resolve(base: Path, value: str) -> Path:
    """Resolve a manifest path: absolute stays, relative is taken against the manifest's folder."""
    p = Path(value).expanduser()
    if not p.is_absolute():
        p = base / p
    # absolute() not resolve(): keep symlinked dataset layouts readable in error messages.
    return Path(_normpath(p))


def _normpath(p: Path) -> str:
    return os.path.normpath(str(p.absolute()))


def _to_codes(value: Any) -> ManifestCodes:
    """Convert a JSON list of frames (each a list of ints) into `ManifestCodes`, or raise ValueError."""
    if not isinstance(value, list) or not value:
        raise ValueError("audio_codes must be a non-empty list of frames")
    width: int | None = None
    for frame in value:
        if not isinstance(frame, list) or not all(isinstance(c, int) and not isinstance(c, bool) for c in frame):
            raise ValueError("audio_codes frames must be lists of integers")
        if width is None:
            width = len(frame)
        elif len(frame) != width:
            raise ValueError(f"audio_codes frames have different widths ({width} and {len(frame)})")
    shape = (len(value), int(width or 0))
    bounds = np.iinfo(np.int32)
    try:
        codes = np.array(value, dtype=np.int64).reshape(shape)
    except OverflowError:
        codes = None
    if codes is None or (codes.size and (codes.min() < bounds.min or codes.max() > bounds.max)):
        raise ValueError("audio_codes values must be codec codes (32-bit integers)")
    # Their range against the codebook is the codec cache's check (`check_codes`), as for encoded ones.
    return ManifestCodes(codes.astype(np.int32).tobytes(), shape)


def read_jsonl(path: Path, default_speaker: str = "speaker", encoding: str | None = None) -> ManifestResult:
    """Read a Qwen3-TTS style JSONL: one object per line with audio, text, ref_audio (+ optional keys)."""
    path = Path(path)
    base = path.parent
    records: list[ClipRecord] = []
    rejected: list[Rejection] = []
    for lineno, line in enumerate(_lines(read_text(path, encoding)), start=1):
        if not line.strip():
            continue  # blank lines (e.g. trailing newline) are not entries
        source = f"{path.name}:{lineno}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            rejected.append(Rejection(source, None, "malformed_entry", f"invalid JSON: {exc.msg} (column {exc.colno})"))
            continue
        if not isinstance(entry, dict):
            rejected.append(Rejection(source, None, "malformed_entry", "line is not a JSON object"))
            continue
        audio = entry.get("audio")
        if not isinstance(audio, str) or not audio.strip():
            rejected.append(Rejection(source, None, "malformed_entry", "missing or non-string 'audio' key"))
            continue
        text = entry.get("text")
        subtitles = None
        if text is None or (isinstance(text, str) and not text.strip()):
            # No transcript of its own: a long recording when subtitles lie beside it.
            subtitles = subtitles_for(_resolve(base, audio))
            if subtitles is not None:
                text = ""
        if not isinstance(text, str):
            rejected.append(Rejection(source, audio, "malformed_entry", "missing or non-string 'text' key"))
            continue
        ref = entry.get("ref_audio")
        if ref is not None and not isinstance(ref, str):
            rejected.append(Rejection(source, audio, "malformed_entry", "'ref_audio' must be a string path"))
            continue
        # null (what pandas' to_json writes for a missing value) is the same as an absent key.
        speaker = entry.get("speaker")
        speaker = default_speaker if speaker is None else speaker
        language = entry.get("language")
        language = "auto" if language is None else language
        if not isinstance(speaker, str) or not speaker.strip() or not isinstance(language, str):
            rejected.append(
                Rejection(source, audio, "malformed_entry", "'speaker' and 'language' must be non-empty strings")
            )
            continue
        instruct = entry.get("instruct")
        if instruct is not None and not isinstance(instruct, str):
            rejected.append(Rejection(source, audio, "malformed_entry", "'instruct' must be a string"))
            continue
        codes = None
        if entry.get("audio_codes") is not None:
            try:
                codes = _to_codes(entry["audio_codes"])
            except ValueError as exc:
                rejected.append(Rejection(source, audio, "malformed_entry", str(exc)))
                continue
        records.append(
            ClipRecord(
                audio=_resolve(base, audio),
                text=_clean_text(text),
                speaker=speaker.strip(),
                source=source,
                ref_audio=_resolve(base, ref) if ref and ref.strip() else None,
                language=language or "auto",
                audio_codes=codes,
                subtitles=subtitles,
                instruct=(instruct or "").strip(),
            )
        )
    return ManifestResult(records, rejected)


def _lines(text: str) -> list[str]:
    """Lines as numbered by an editor (\\n, \\r\\n); separators inside JSON strings stay put."""
    return text.replace("\r\n", "\n").split("\n")


def _split_ljspeech_row(line: str) -> list[str]:
    """``id|text[|normalized]`` -> its columns.

    A plain split, unless a field is CSV-quoted around a ``|`` (``"a | b"``): then the quoted
    reading, when it is valid quoting and gives fewer columns (a valid row). Quotes that hide no
    ``|`` are the text's own (LJSpeech has no CSV quoting: ``"Hello world"``, ``He said "hi``).
    Raises csv.Error for broken quoting only when the plain split is no valid row either.
    """
    line = line.rstrip()  # trailing spaces after a closing quote are not part of any field
    cols = line.split("|")
    if any(c.lstrip().startswith('"') for c in cols):
        try:
            quoted = next(csv.reader([line], delimiter="|", quotechar='"', skipinitialspace=True, strict=True), [])
        except csv.Error:
            if len(cols) in (2, 3):
                return cols
            raise
        if len(quoted) < len(cols) and len(quoted) in (2, 3):
            return quoted
    return cols


# First columns of a header row that spreadsheets and dataset tools write above `id|text` rows.
LJSPEECH_HEADER_IDS = frozenset({"id", "file", "filename", "file_name", "file_id", "name", "audio", "wav", "path"})


def read_ljspeech_csv(path: Path, default_speaker: str = "speaker", encoding: str | None = None) -> ManifestResult:
    """Read an LJSpeech metadata.csv: `id|text` or `id|text|normalized`, audio in `wavs/<id>.wav`."""
    path = Path(path)
    wavs = path.parent / "wavs"
    records: list[ClipRecord] = []
    rejected: list[Rejection] = []
    for lineno, line in enumerate(_lines(read_text(path, encoding)), start=1):
        if not line.strip():
            continue
        source = f"{path.name}:{lineno}"
        try:
            cols = _split_ljspeech_row(line)
        except csv.Error as exc:
            rejected.append(Rejection(source, None, "malformed_entry", f"{path}:{lineno}: bad CSV quoting ({exc})"))
            continue
        if len(cols) not in (2, 3):
            hint = (
                "a stray '|' at the end of the line?"
                if len(cols) > 3 and not cols[-1].strip()
                else "a '|' inside the text? quote that field (\"...\") or remove the '|'"
                if len(cols) > 3
                else "no '|' separator on this line"
            )
            rejected.append(
                Rejection(
                    source,
                    None,
                    "malformed_entry",
                    f"{path}:{lineno}: expected 2 or 3 '|'-separated columns (id|text or id|text|normalized), "
                    f"got {len(cols)}: {hint}",
                )
            )
            continue
        clip_id = cols[0].strip()
        if not clip_id:
            rejected.append(
                Rejection(source, None, "malformed_entry", f"{path}:{lineno}: empty clip id in first column")
            )
            continue
        if lineno == 1 and clip_id.lower() in LJSPEECH_HEADER_IDS and not (wavs / f"{clip_id}.wav").exists():
            continue  # a header row (LJSpeech has none; exported spreadsheets do): not a clip
        text = cols[2] if len(cols) == 3 and cols[2].strip() else cols[1]
        audio = wavs / f"{clip_id}.wav"
        records.append(
            ClipRecord(audio=Path(_normpath(audio)), text=_clean_text(text), speaker=default_speaker, source=source)
        )
    return ManifestResult(records, rejected)


def _folder_files(root: Path) -> list[Path]:
    """Every file below ``root`` (sorted) except hidden ones (``.x``, macOS ``._x``) and those in
    hidden or tagged cache sub-folders; symlinked folders are not followed."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        # Pruned in place so os.walk never enters them (root itself is read even if tagged: it was asked for).
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and not is_cache_dir(here / d)]
        found += [here / name for name in filenames if not name.startswith(".")]
    return sorted(found)


def _lossless_first(audio: Path) -> tuple[bool, str]:
    return audio.suffix.lower() not in _LOSSLESS, audio.name


def _transcript_for(audio: Path) -> Path:
    """The ``.txt`` (or ``.TXT``) beside ``audio``; the ``.txt`` name when there is none."""
    upper = audio.with_suffix(".TXT")
    return upper if upper.is_file() and not audio.with_suffix(".txt").is_file() else audio.with_suffix(".txt")


def read_folder(root: Path, default_speaker: str = "speaker", encoding: str | None = None) -> ManifestResult:
    """Read a folder of audio files with same-named .txt transcripts; sub-folder name = speaker.

    A transcript (.txt, .srt, .vtt) without audio beside it and an audio file in a format soundfile
    cannot decode are rejections. Hidden files and folders and folders holding a CACHEDIR.TAG are skipped.
    """
    root = Path(root)
    records: list[ClipRecord] = []
    rejected: list[Rejection] = []
    files = _folder_files(root)
    audio_stems = {
        (p.parent, p.stem) for p in files if p.suffix.lower() in AUDIO_EXTENSIONS | _UNSUPPORTED_AUDIO_EXTENSIONS
    }
    # Recordings beside one transcript (003.wav, 003.mp3 and 003.txt) are the same utterance: one is
    # kept, lossless before lossy, then by name; the others are duplicates.
    beside: dict[tuple[Path, str], Path] = {}
    for p in sorted((p for p in files if p.suffix.lower() in AUDIO_EXTENSIONS), key=_lossless_first):
        beside.setdefault((p.parent, p.stem), p)

    for path in files:
        rel = path.relative_to(root)
        source = rel.as_posix()
        ext = path.suffix.lower()
        if ext in _UNSUPPORTED_AUDIO_EXTENSIONS:
            rejected.append(
                Rejection(
                    source,
                    str(path),
                    "unreadable_audio",
                    f"{source}: audio format {ext} is not supported (supported: {_SUPPORTED_LIST}); "
                    f"convert it, e.g. ffmpeg -i {path.name} {path.stem}.wav",
                )
            )
            continue
        if ext in (".txt", *SUBTITLE_EXTENSIONS):
            if (path.parent, path.stem) not in audio_stems:
                rejected.append(
                    Rejection(
                        source,
                        None,
                        "missing_file",
                        f"transcript {source} has no audio file ({_SUPPORTED_LIST}) beside it",
                    )
                )
            continue
        if ext not in AUDIO_EXTENSIONS:
            continue  # notes, images, metadata: not part of any clip
        # The first sub-folder names the speaker, whatever depth lies below it.
        speaker = rel.parts[0] if len(rel.parts) > 1 else default_speaker
        txt = _transcript_for(path)
        subtitles = None if txt.is_file() else subtitles_for(path)
        kept = beside[(path.parent, path.stem)]
        if kept != path and (subtitles is not None or txt.is_file()):
            detail = (
                f"{source} shares {(subtitles or txt).name} with {kept.relative_to(root).as_posix()}, which is "
                "trained (one recording per transcript: give this one its own or remove it)"
            )
            rejected.append(Rejection(source, str(path), "duplicate", detail))
            continue
        if subtitles is not None:
            records.append(
                ClipRecord(
                    audio=Path(_normpath(path)),
                    text="",
                    speaker=speaker,
                    source=source,
                    subtitles=Path(_normpath(subtitles)),
                )
            )
            continue
        if not txt.is_file():
            rejected.append(
                Rejection(source, str(path), "no_transcript", f"no transcript file {txt.name} next to {source}")
            )
            continue
        try:
            text = _clean_text(read_text(txt, encoding))
        except ManifestEncodingError as exc:
            rejected.append(Rejection(source, str(path), "malformed_entry", str(exc)))
            continue
        except OSError as exc:
            rejected.append(Rejection(source, str(path), "malformed_entry", f"cannot read {txt}: {exc}"))
            continue
        records.append(ClipRecord(audio=Path(_normpath(path)), text=text, speaker=speaker, source=source))
    return ManifestResult(records, rejected)


def load_manifest(path: str | Path, default_speaker: str = "speaker", encoding: str | None = None) -> ManifestResult:
    """Read a manifest, choosing the reader from the path.

    ``encoding`` is the text encoding of the manifest and transcript files (default UTF-8);
    bytes that are not valid in it raise `ManifestEncodingError` naming the file, line and byte.

    - `*.jsonl` file: Qwen3-TTS JSONL.
    - `*.csv` file (e.g. `metadata.csv`): LJSpeech pipe-separated rows.
    - a directory holding `metadata.csv`: LJSpeech dataset root.
    - any other directory: folder of audio files with `.txt` transcripts.
    """
    p = Path(path).expanduser()
    if not p.exists():
        where = "" if p.is_absolute() else f" (relative to the current folder, {Path.cwd()})"
        raise FileNotFoundError(f"manifest not found: {p}{where}")
    if p.is_dir():
        if (p / "metadata.csv").is_file():
            return read_ljspeech_csv(p / "metadata.csv", default_speaker, encoding)
        return read_folder(p, default_speaker, encoding)
    suffix = p.suffix.lower()
    if suffix == ".jsonl":
        return read_jsonl(p, default_speaker, encoding)
    if suffix == ".csv":
        return read_ljspeech_csv(p, default_speaker, encoding)
    raise ValueError(
        f"unknown manifest format for {p}: expected a .jsonl file, a metadata.csv/.csv file, or a folder of clips"
    )
