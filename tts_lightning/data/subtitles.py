"""Long recordings with subtitles -> clips, cut at the subtitle timestamps.

A manifest entry (or folder item) whose audio has an ``.srt`` or ``.vtt`` file beside it (same
stem) and no transcript of its own is a long recording: `cut_subtitled` replaces it by one clip per
cue, or per run of adjacent cues merged up to ``target_seconds``. Cues are never merged across a
speaker change (WebVTT ``<v Name>`` voice tags, or an upper-case ``NAME:`` prefix; an unlabelled cue
continues the previous cue's speaker), across a gap of
more than `MAX_MERGE_GAP` seconds, or with a cue whose text is empty after markup is removed (that
one becomes a clip of its own, which validation then rejects as ``empty_transcript``).

Each cut is written once, at the recording's own sample rate and sample format, under
``<cache_dir>/segments/<key>/``, ``key`` naming the recording (path, size, modification time), the
subtitle file's bytes and the settings; a second run with the same inputs reads the folder's
``segments.json`` and cuts nothing. The cut clips go through validation like any clip.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import soundfile as sf

from tts_lightning.data.manifest import ClipRecord, ManifestEncodingError, ManifestResult, Rejection, read_text
from tts_lightning.files import atomic_write_json, staged_directory

SEGMENTS_VERSION = 1
MAX_MERGE_GAP = 1.0  # seconds of silence between two cues that may still be merged into one clip

_TIME = r"(?:(\d+):)?(\d{1,2}):(\d{2})[,.](\d{1,3})"
_TIMING = re.compile(rf"^\s*{_TIME}\s*-->\s*{_TIME}(?:\s.*)?$")
_VOICE = re.compile(r"<v(?:\.[^\s>]*)?\s+([^>]+)>")
_TAG = re.compile(r"<[^>]*>|\{\\[^}]*\}")
_NAME_PREFIX = re.compile(r"^\s*-?\s*([A-Z][A-Z0-9.'\- ]{0,38}[A-Z0-9.]|[A-Z]):\s+")


class SubtitleError(ValueError):
    """A subtitle file that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class Cue:
    start: float  # seconds
    end: float
    text: str  # markup removed
    speaker: str | None
    line: int  # line of the timing in the subtitle file


@dataclass(frozen=True)
class Segment:
    """One cut clip: which cues of which recording, where in it, and its file."""

    recording: str
    subtitles: str
    cues: str  # "3" or "3-5" (1-based cue numbers)
    start: float
    end: float
    speaker: str
    text: str
    audio: str  # the cut clip (its file name in segments.json, the full path once loaded)


def _seconds(h: str | None, m: str, s: str, frac: str) -> float:
    return int(h or 0) * 3600 + int(m) * 60 + int(s) + int(frac.ljust(3, "0")) / 1000


def _clean(lines: list[str]) -> tuple[str, str | None]:
    """Cue text lines -> (plain text, speaker or None)."""
    raw = " ".join(line.strip() for line in lines if line.strip())
    speaker = None
    voice = _VOICE.search(raw)
    if voice:
        speaker = voice.group(1).strip()
    text = re.sub(r"\s+", " ", _TAG.sub("", raw)).strip()
    if speaker is None:
        prefix = _NAME_PREFIX.match(text)
        if prefix:
            speaker = prefix.group(1).strip()
            text = text[prefix.end() :].strip()
    return text, speaker


def parse_subtitles(path: str | os.PathLike, encoding: str | None = None) -> list[Cue]:
    """SRT or WebVTT cues in file order; `SubtitleError` names the file and line of a bad timing.

    A cue without a speaker label has the speaker of the cue before it (subtitles usually label
    only a change of speaker); cues before the first label have none."""
    path = Path(path)
    lines = read_text(path, encoding).replace("\r\n", "\n").replace("\r", "\n").split("\n")
    vtt = path.suffix.lower() == ".vtt"
    if vtt and not (lines and lines[0].lstrip("\ufeff").startswith("WEBVTT")):
        raise SubtitleError(f"{path}:1: a WebVTT file must start with 'WEBVTT'")
    cues: list[Cue] = []
    i = 0
    if vtt:  # the header block: WEBVTT and any header lines (Kind:, Language:, ...)
        while i < len(lines) and lines[i].strip():
            i += 1
    while i < len(lines):
        if not lines[i].strip():
            i += 1
            continue
        block_start = i
        block = []
        while i < len(lines) and lines[i].strip():
            block.append(lines[i])
            i += 1
        if vtt and block[0].split(maxsplit=1)[0] in ("NOTE", "STYLE", "REGION"):
            continue
        timing = next((k for k, line in enumerate(block) if "-->" in line), None)
        if timing is None or timing > 1:
            raise SubtitleError(f"{path}:{block_start + 1}: expected a cue timing 'HH:MM:SS,mmm --> HH:MM:SS,mmm'")
        match = _TIMING.match(block[timing])
        lineno = block_start + timing + 1
        if match is None:
            raise SubtitleError(f"{path}:{lineno}: cannot read the cue timing {block[timing].strip()!r}")
        g = match.groups()
        start, end = _seconds(*g[:4]), _seconds(*g[4:])
        if end <= start:
            raise SubtitleError(f"{path}:{lineno}: cue ends ({end:.3f} s) before it starts ({start:.3f} s)")
        text, speaker = _clean(block[timing + 1 :])
        if speaker is None and cues:
            speaker = cues[-1].speaker  # a label marks a change of speaker; unlabelled cues continue
        cues.append(Cue(start, end, text, speaker, lineno))
    return cues


def subtitle_speakers(record: ClipRecord, encoding: str | None = None) -> set[str]:
    """The speakers a subtitled record's clips will have (unreadable subtitles: the record's own)."""
    if record.subtitles is None:
        return {record.speaker}
    try:
        cues = parse_subtitles(record.subtitles, encoding)
    except (SubtitleError, ManifestEncodingError, OSError):
        return {record.speaker}
    return {cue.speaker or record.speaker for cue in cues} or {record.speaker}


def merge_cues(cues: list[Cue], target_seconds: float) -> list[list[int]]:
    """Indices of the cues of each clip: adjacent cues joined while the clip stays within
    ``target_seconds``, same speaker, gaps of at most `MAX_MERGE_GAP`, and non-empty text."""
    groups: list[list[int]] = []
    for k, cue in enumerate(cues):
        if groups:
            first, last = cues[groups[-1][0]], cues[groups[-1][-1]]
            if (
                cue.text
                and last.text
                and cue.speaker == last.speaker
                and cue.start - last.end <= MAX_MERGE_GAP
                and cue.start >= last.end
                and cue.end - first.start <= target_seconds
            ):
                groups[-1].append(k)
                continue
        groups.append([k])
    return groups


def _key(record: ClipRecord, subtitles: Path, settings: dict) -> str:
    st = os.stat(record.audio)
    h = hashlib.sha256(json.dumps({"version": SEGMENTS_VERSION, **settings}, sort_keys=True).encode())
    h.update(f"{record.audio}|{st.st_size}|{st.st_mtime_ns}|{record.speaker}|{record.language}|".encode())
    h.update(subtitles.read_bytes())
    return h.hexdigest()[:20]


def _write_format(info) -> tuple[str, str]:
    """(subtype to write, dtype to read) keeping the recording's samples exactly where WAV can."""
    subtype = info.subtype if sf.check_format("WAV", info.subtype) else "FLOAT"
    dtype = {"PCM_16": "int16", "PCM_24": "int32", "PCM_32": "int32", "DOUBLE": "float64"}.get(subtype, "float32")
    return subtype, dtype


def _cut(record: ClipRecord, subtitles: Path, cues: list[Cue], groups: list[list[int]], folder: Path) -> list[Segment]:
    segments: list[Segment] = []
    with sf.SoundFile(record.audio) as f:
        subtype, dtype = _write_format(f)
        rate, frames = f.samplerate, f.frames
        for n, group in enumerate(groups, start=1):
            first, last = cues[group[0]], cues[group[-1]]
            start = min(frames, round(first.start * rate))
            end = min(frames, round(last.end * rate))
            f.seek(start)
            data = f.read(end - start, dtype=dtype, always_2d=True)
            out = folder / f"{record.audio.stem}_{n:04d}.wav"
            if len(data):
                sf.write(out, data, rate, subtype=subtype, format="WAV")
            else:  # a cue past the end of the audio: an empty file, rejected by validation
                out.write_bytes(b"")
            numbers = f"{group[0] + 1}" if len(group) == 1 else f"{group[0] + 1}-{group[-1] + 1}"
            segments.append(
                Segment(
                    recording=str(record.audio),
                    subtitles=str(subtitles),
                    cues=numbers,
                    start=round(start / rate, 4),
                    end=round(end / rate, 4),
                    speaker=first.speaker or record.speaker,
                    text=" ".join(cues[k].text for k in group if cues[k].text),
                    audio=out.name,
                )
            )
    return segments


def cut_subtitled(
    manifest: ManifestResult,
    segments_dir: str | os.PathLike,
    *,
    target_seconds: float = 10.0,
    encoding: str | None = None,
) -> tuple[ManifestResult, list[Segment]]:
    """Replace every subtitled record by the clips cut from it; the others pass through in order.

    A subtitle file that cannot be read rejects its recording (``malformed_entry``, naming the file
    and line). Returns the new manifest and every segment.
    """
    segments_dir = Path(segments_dir)
    records: list[ClipRecord] = []
    rejected = list(manifest.rejected)
    all_segments: list[Segment] = []
    settings = {"target_seconds": target_seconds, "max_merge_gap": MAX_MERGE_GAP, "encoding": encoding}
    for record in manifest.records:
        subs = record.subtitles
        if subs is None:
            records.append(record)
            continue
        try:
            cues = parse_subtitles(subs, encoding)
            key = _key(record, subs, settings)
        except (SubtitleError, ManifestEncodingError) as exc:
            rejected.append(Rejection(record.source, str(record.audio), "malformed_entry", str(exc)))
            continue
        except OSError as exc:
            rejected.append(
                Rejection(record.source, str(record.audio), "missing_file", f"{exc.filename}: {exc.strerror}")
            )
            continue
        if not cues:
            rejected.append(Rejection(record.source, str(record.audio), "malformed_entry", f"{subs}: no cues"))
            continue
        folder = segments_dir / key
        index = folder / "segments.json"
        if not index.is_file():
            with staged_directory(folder) as tmp:
                try:
                    cut = _cut(record, subs, cues, merge_cues(cues, target_seconds), tmp)
                except (sf.SoundFileError, RuntimeError) as exc:
                    rejected.append(Rejection(record.source, str(record.audio), "unreadable_audio", str(exc)))
                    continue
                atomic_write_json(tmp / "segments.json", [asdict(s) for s in cut])
                try:
                    os.replace(tmp, folder)
                except OSError:
                    if not index.is_file():  # not another process's identical cut: a real failure
                        raise
        found = [Segment(**s) for s in json.loads(index.read_text(encoding="utf-8"))]
        for seg in found:
            seg = replace(seg, audio=str(folder / seg.audio))
            all_segments.append(seg)
            records.append(
                ClipRecord(
                    audio=Path(seg.audio),
                    text=seg.text,
                    speaker=seg.speaker,
                    source=f"{record.source} cue {seg.cues} ({seg.start:.2f}-{seg.end:.2f} s)",
                    ref_audio=record.ref_audio,
                    language=record.language,
                )
            )
    return ManifestResult(records, rejected), all_segments
