"""Long recordings with subtitles -> clips, cut at the subtitle timestamps.

A manifest entry (or folder item) whose audio has an ``.srt`` or ``.vtt`` file beside it (same
stem) and no transcript of its own is a long recording: `cut_subtitled` replaces it by one clip per
cue, or per run of adjacent cues merged up to ``target_seconds`` (and ``max_duration``). Cues are
never merged across a speaker change, across a gap of more than `MAX_MERGE_GAP` seconds, or with a
cue whose text is empty after markup is removed (that one becomes a clip of its own, which
validation then rejects as ``empty_transcript``).

Speakers: in WebVTT only a ``<v Name>`` voice tag names the speaker (the format's own way); in SRT
an upper-case ``NAME:`` at the start of a line does (``JOHN: Hi``, ``- JOHN: Hi``), except a word
such as ``NOTE:`` or ``WARNING:`` that labels the text rather than a person (`NOT_SPEAKERS`). An
unlabelled cue continues the previous cue's speaker. A cue with lines by two speakers (two
labels, or dialogue dashes with one labelled line) cannot be cut apart and is rejected; dialogue
dashes without labels are kept as one text.

Text: markup is removed (tags starting with a letter or ``/``, WebVTT timestamps ``<00:01.000>``,
ASS overrides ``{\\an8}``; a bare ``<`` is text), then HTML entities are decoded (``&amp;``) and
whitespace is collapsed. A text block after a blank line inside a cue continues that cue's text.

Nothing is dropped silently: a cue that cannot be used (bad or zero-length timing, two speakers,
starting after the end of the recording) becomes a ``malformed_entry`` rejection naming the
subtitle file and line, a cue longer than ``max_duration`` a ``too_long`` one (not cut), and the
other cues are still cut; a subtitle file without one usable cue rejects its recording.

Each cut is written once, at the recording's own sample rate and, for PCM and float sources, its
own sample format (a lossy or otherwise compressed source is written as the float samples it
decodes to), under ``<cache_dir>/segments/<tag>-<key>/``: ``tag`` names the recording's path,
``key`` the recording (path, size, modification time), the subtitle file and the settings. A second
run with the same inputs reads the folder's ``segments.json`` and cuts nothing, unless a clip it
lists is missing or changed; a new cut of a recording removes its cuts of other inputs (an earlier
recording or subtitle file) and those of an earlier `SEGMENTS_VERSION` (a cut with other settings
stays, another run may be reading it). The cut clips go through validation like any clip.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import html
import json
import math
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf

from tts_lightning.data.manifest import ClipRecord, ManifestEncodingError, ManifestResult, Rejection, read_text
from tts_lightning.files import WriteError, atomic_write_json, staged_directory

SEGMENTS_VERSION = 3
MAX_MERGE_GAP = 1.0  # seconds of silence between two cues that may still be merged into one clip
# Upper-case words that label an SRT line's text rather than name its speaker ("NOTE: bring the keys.").
NOT_SPEAKERS = frozenset(
    {"NOTE", "NB", "N.B.", "PS", "P.S.", "WARNING", "CAUTION", "TIP", "HINT", "IMPORTANT", "ATTENTION"}
    | {"REMINDER", "UPDATE", "EDIT", "FYI", "INFO", "NEWS", "BREAKING", "ALERT", "DISCLAIMER"}
)

_TIME = r"(?:(\d+):)?(\d{1,2}):(\d{2})[,.](\d{1,3})"
_TIMING = re.compile(rf"^\s*{_TIME}\s*-->\s*{_TIME}(?:\s.*)?$")
_LOOSE_TIME = re.compile(r"\d:\d{2}[,.:]\d{3}")  # a timing someone tried to write, however broken
_VOICE = re.compile(r"<v(?:\.[^\s>]*)?\s+([^>]+)>")
# Markup only: a "<" that is not followed by a letter or "/" is text ("5 < 10").
_TAG = re.compile(r"</?[A-Za-z][^<>]*>|<(?:\d+:)?\d{2}:\d{2}[.,]\d{3}>|\{\\[^}]*\}")
_DASH = re.compile(r"^[-\u2010\u2013\u2014]+\s*(?!\d)")  # a dialogue dash, not a minus sign ("-5 degrees")
_NAME_PREFIX = re.compile(r"^([A-Z][A-Z0-9.'\- ]{0,38}[A-Z0-9.]|[A-Z]):(?:\s+|$)")
_BLOCK_FRAMES = 1 << 16  # frames decoded at a time while cutting


class SubtitleError(ValueError):
    """A subtitle file (or one cue of it) that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class Cue:
    start: float  # seconds
    end: float
    text: str  # markup removed
    speaker: str | None
    line: int  # line of the timing in the subtitle file
    number: int = 0  # 1-based position among the file's cues, unusable ones included (0: unknown)


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


def _clean(lines: list[str], *, names: bool) -> tuple[str, list[str], str | None]:
    """Cue text lines -> (plain text, the speakers it names in order, why it cannot be one clip or
    None). ``names``: whether an upper-case ``NAME:`` at the start of a line names its speaker (SRT)."""
    parts: list[str] = []
    voices: list[str] = []  # WebVTT <v Name>
    labels: list[str] = []  # SRT NAME:
    dashes = unlabelled_dashes = 0
    for raw in lines:
        voices += [v.strip() for v in _VOICE.findall(raw)]
        line = re.sub(r"\s+", " ", html.unescape(_TAG.sub("", raw))).strip()  # &nbsp; -> space, then collapsed
        dash = _DASH.match(line)
        if dash:
            line = line[dash.end() :].strip()
            dashes += 1
        prefix = _NAME_PREFIX.match(line) if names else None
        if prefix and prefix.group(1).strip() not in NOT_SPEAKERS:
            labels.append(prefix.group(1).strip())
            line = line[prefix.end() :].strip()
        elif dash:
            unlabelled_dashes += 1
        if line:
            parts.append(line)
    speakers = list(dict.fromkeys(voices + labels))
    problem = None
    if len(speakers) > 1:
        problem = f"lines by {len(speakers)} speakers ({', '.join(speakers)}) in one cue, which cannot be cut apart"
    elif labels and dashes > 1 and unlabelled_dashes:
        # Dialogue dashes mark a change of speaker: the unlabelled line is someone other than the labelled one.
        problem = f"dialogue lines by {labels[0]} and by an unnamed speaker in one cue, which cannot be cut apart"
    return " ".join(parts), speakers, problem


def _is_text(block: list[str]) -> bool:
    """Whether a block without a cue timing reads as more text of the cue before it (a blank line
    inside a cue's text) rather than a cue whose timing is broken or missing."""
    numbered = block[0].strip().isdigit()  # an SRT cue number (then more, or its timing after a blank line)
    return not numbered and not any(_LOOSE_TIME.search(line) for line in block)


def parse_subtitles(
    path: str | os.PathLike, encoding: str | None = None, problems: list[SubtitleError] | None = None
) -> list[Cue]:
    """SRT or WebVTT cues in file order. A cue that cannot be used raises `SubtitleError` naming the
    file and line; with ``problems``, it is appended there instead and the other cues are returned.

    A cue without a speaker label has the speaker of the cue before it (subtitles usually label
    only a change of speaker); cues before the first label have none."""
    path = Path(path)
    lines = read_text(path, encoding).replace("\r\n", "\n").replace("\r", "\n").split("\n")
    vtt = path.suffix.lower() == ".vtt"
    if vtt and not (lines and lines[0].lstrip("\ufeff").startswith("WEBVTT")):
        raise SubtitleError(f"{path}:1: a WebVTT file must start with 'WEBVTT'")

    # Blocks of non-blank lines, a block of plain text joined to the cue before it.
    entries: list[tuple[int, list[str]]] = []  # (index of the first line, lines)
    i = 0
    if vtt:  # the header block: WEBVTT and any header lines (Kind:, Language:, ...)
        while i < len(lines) and lines[i].strip():
            i += 1
    while i < len(lines):
        if not lines[i].strip():
            i += 1
            continue
        block_start, block = i, []
        while i < len(lines) and lines[i].strip():
            block.append(lines[i])
            i += 1
        if vtt and block[0].split(maxsplit=1)[0] in ("NOTE", "STYLE", "REGION"):
            continue
        if entries and not any("-->" in line for line in block) and _is_text(block):
            entries[-1][1].extend(block)
        elif len(block) == 1 and block[0].strip().isdigit():
            continue  # a cue number alone, its timing after a blank line: the next block is the cue
        else:
            entries.append((block_start, block))

    cues: list[Cue] = []
    speaker = None  # the current speaker: a label marks a change of speaker

    def bad(line: int, message: str) -> None:
        error = SubtitleError(f"{path}:{line}: {message}")
        if problems is None:
            raise error
        problems.append(error)

    for number, (block_start, block) in enumerate(entries, start=1):
        timings = [k for k, line in enumerate(block) if "-->" in line]
        if not timings or timings[0] > 1:
            bad(block_start + 1, f"cue {number}: expected a cue timing 'HH:MM:SS,mmm --> HH:MM:SS,mmm'")
            continue
        k = timings[0]
        lineno = block_start + k + 1
        match = _TIMING.match(block[k])
        if match is None:
            bad(lineno, f"cue {number}: cannot read the cue timing {block[k].strip()!r}")
            continue
        text, speakers, problem = _clean(block[k + 1 :], names=not vtt)
        if speakers:
            speaker = speakers[-1]  # also from an unusable cue: the cues after it continue its speaker
        if len(timings) > 1:
            bad(lineno, f"cue {number}: another cue timing inside its text; separate cues by a blank line")
            continue
        g = match.groups()
        start, end = _seconds(*g[:4]), _seconds(*g[4:])
        if end == start:
            bad(lineno, f"cue {number} has zero length (starts and ends at {start:.3f} s)")
        elif end < start:
            bad(lineno, f"cue {number} ends ({end:.3f} s) before it starts ({start:.3f} s)")
        elif problem:
            bad(lineno, f"cue {number}: {problem}")
        else:
            cues.append(Cue(start, end, text, speaker, lineno, number))
    return cues


def subtitle_speakers(record: ClipRecord, encoding: str | None = None) -> set[str]:
    """The speakers a subtitled record's clips will have (unreadable subtitles: the record's own)."""
    if record.subtitles is None:
        return {record.speaker}
    try:
        cues = parse_subtitles(record.subtitles, encoding, problems=[])
    except (SubtitleError, ManifestEncodingError, OSError):
        return {record.speaker}
    return {cue.speaker or record.speaker for cue in cues} or {record.speaker}


def merge_cues(cues: list[Cue], target_seconds: float) -> list[list[int]]:
    """Indices of the cues of each clip: adjacent cues joined while the clip stays within
    ``target_seconds``, same speaker, gaps of at most `MAX_MERGE_GAP`, and non-empty text; never
    across a cue left out as unusable (its audio would be in the clip, its text not)."""
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
                and (not cue.number or cue.number == last.number + 1)
            ):
                groups[-1].append(k)
                continue
        groups.append([k])
    return groups


def _inputs(record: ClipRecord, subtitles: Path) -> dict[str, Any]:
    """What a cut is made from: the recording's size and modification time, the subtitles' bytes."""
    st = os.stat(record.audio)
    return {"audio": [st.st_size, st.st_mtime_ns], "subtitles": hashlib.sha256(subtitles.read_bytes()).hexdigest()}


def _folder_name(record: ClipRecord, subtitles: Path, settings: dict, inputs: dict[str, Any]) -> str:
    """``<tag>-<key>``: ``tag`` names the recording's path, so that its cuts under other keys can be
    found; ``key`` what the cut depends on (the record's speaker is applied when the cut is loaded)."""
    key = {"version": SEGMENTS_VERSION, **settings, "recording": str(record.audio), "subtitles": str(subtitles)}
    h = hashlib.sha256(json.dumps({**key, **inputs}, sort_keys=True).encode())
    return f"{hashlib.sha256(str(record.audio).encode()).hexdigest()[:12]}-{h.hexdigest()[:20]}"


# Subtypes WAV stores as they are (-> the dtype that reads them exactly). Anything else (MP3, Vorbis,
# Opus, ADPCM, ...) libsndfile cannot write into WAV, or not without another lossy pass: its decoded
# float samples are written.
_EXACT_SUBTYPES = {
    "PCM_U8": "int16",
    "PCM_16": "int16",
    "PCM_24": "int32",
    "PCM_32": "int32",
    "FLOAT": "float32",
    "DOUBLE": "float64",
}
_CTYPES = {"int16": "short", "int32": "int", "float32": "float", "float64": "double"}


def _write_format(info) -> tuple[str, str]:
    """(subtype to write, dtype to read): the recording's own samples where WAV can hold them."""
    if info.subtype in _EXACT_SUBTYPES:
        return info.subtype, _EXACT_SUBTYPES[info.subtype]
    return "FLOAT", "float32"


def _decode(f: sf.SoundFile, dtype: str) -> Iterator[tuple[int, np.ndarray]]:
    """The recording's frames from its start, in order, as (first frame, block): decoded in one pass.

    Straight from libsndfile: `SoundFile.read` seeks to its own position after every read, and
    libsndfile's seeks are not sample-accurate for every codec (a Vorbis cut read after a seek can be
    256 samples off; an MP3 decoder loses its bit reservoir and returns wrong samples). It uses
    soundfile's own bindings (``_snd``, ``_ffi``, ``_file``: unchanged from 0.10 to 0.14); the test
    of lossy cuts compares every cut with `sf.read` of the whole file, so a change shows there."""
    ctype = _CTYPES[dtype]
    # From a seek to the start, as `sf.read` decodes: after one, an MP3 decodes a float's last bit
    # differently from a freshly opened file.
    f.seek(0)
    read = getattr(sf._snd, f"sf_readf_{ctype}")
    block = np.empty((_BLOCK_FRAMES, f.channels), dtype=dtype)
    pointer = sf._ffi.cast(f"{ctype} *", block.ctypes.data)
    position = 0
    while True:
        n = read(f._file, pointer, _BLOCK_FRAMES)
        sf._error_check(f._errorcode)
        if n <= 0:
            return
        yield position, block[:n]
        position += n


@contextmanager
def _writing(folder: Path) -> Iterator[None]:
    """libsndfile's write errors (a full disk, say) as `WriteError`: they stop the run, naming the
    folder and its free space, instead of rejecting the recording as unreadable audio."""
    try:
        yield
    except (sf.SoundFileError, RuntimeError) as exc:
        raise WriteError(folder, OSError(errno.EIO, str(exc))) from exc


def _cut(
    record: ClipRecord, subtitles: Path, cues: list[Cue], target_seconds: float, max_duration: float, folder: Path
) -> tuple[list[Segment], list[tuple[str, str]], dict[str, int]]:
    """Cut the clips into ``folder``: (segments, (reason, detail) of each cue rejected, {clip file:
    bytes})."""
    rejected: list[tuple[str, str]] = []

    def past_end(cue: Cue, frames: int, rate: int) -> None:
        rejected.append(
            (
                "malformed_entry",
                f"{subtitles}:{cue.line}: cue {cue.number} starts at {cue.start:.3f} s, "
                f"after the end of the recording ({frames / rate:.3f} s)",
            )
        )

    with sf.SoundFile(record.audio) as f:
        subtype, dtype = _write_format(f)
        rate, channels = f.samplerate, f.channels
        # Cues past the end (as the header tells it) are left out before merging, so that no clip
        # holds the text of a cue without its audio.
        inside = [cue for cue in cues if round(cue.start * rate) < f.frames]
        for cue in cues:
            if round(cue.start * rate) >= f.frames:
                past_end(cue, f.frames, rate)
        groups: list[list[Cue]] = []
        spans: list[tuple[int, int]] = []
        for group in (
            [inside[k] for k in indices] for indices in merge_cues(inside, min(target_seconds, max_duration))
        ):
            span = (round(group[0].start * rate), round(group[-1].end * rate))
            seconds = (min(span[1], f.frames) - span[0]) / rate
            if seconds > max_duration:  # one cue (merged ones stay within it): a typo in the hours, say
                # Not cut: validation would reject the clip after it was written and read in full.
                cue = group[0]
                detail = (
                    f"cue {cue.number} ({cue.start:.3f} s to {cue.end:.3f} s) lasts {seconds:.3f} s in the "
                    f"recording, longer than max_duration {max_duration} s"
                )
                rejected.append(("too_long", f"{subtitles}:{cue.line}: {detail}"))
            else:
                groups.append(group)
                spans.append(span)
        names = [f"{record.audio.stem}_{n:04d}.wav" for n in range(1, len(groups) + 1)]
        # One decoding pass; each clip is written while the pass crosses its span (spans may overlap).
        waiting = sorted(range(len(groups)), key=lambda j: spans[j][0])[::-1]  # next to open last
        open_: dict[int, sf.SoundFile] = {}
        ends: dict[int, int] = {}
        total = 0
        try:
            for position, block in _decode(f, dtype):
                total = position + len(block)
                with _writing(folder):
                    while waiting and spans[waiting[-1]][0] < total:
                        j = waiting.pop()
                        open_[j] = sf.SoundFile(folder / names[j], "w", rate, channels, subtype, format="WAV")
                    for j, out in list(open_.items()):
                        start, end = max(spans[j][0], position), min(spans[j][1], total)
                        if end > start:
                            out.write(block[start - position : end - position])
                        if spans[j][1] <= total:
                            out.close()
                            ends[j] = spans[j][1]
                            del open_[j]
                if not waiting and not open_:
                    break  # the rest of the recording holds no cue
        finally:
            with _writing(folder):
                for j, out in open_.items():  # cues running past the end: cut to the end
                    out.close()
                    ends[j] = total
    segments: list[Segment] = []
    for j, group in enumerate(groups):
        if j not in ends:  # the recording decoded shorter than its header said
            for cue in group:
                past_end(cue, total, rate)
            continue
        numbers = {group[0].number, group[-1].number}
        segments.append(
            Segment(
                recording=str(record.audio),
                subtitles=str(subtitles),
                cues="-".join(str(n) for n in sorted(numbers)),
                start=round(spans[j][0] / rate, 4),
                end=round(ends[j] / rate, 4),
                speaker=group[0].speaker or "",  # "": the record's speaker, applied when loaded
                text=" ".join(cue.text for cue in group if cue.text),
                audio=names[j],
            )
        )
    return segments, rejected, {seg.audio: (folder / seg.audio).stat().st_size for seg in segments}


def _read_index(folder: Path, recording: Path, *, check_files: bool = True) -> dict[str, Any] | None:
    """The folder's segments.json when it is the cut of ``recording`` and every clip it lists is
    there with its size; None (cut again) otherwise."""
    try:
        index = json.loads((folder / "segments.json").read_text(encoding="utf-8"))
        if index["recording"] != str(recording) or not isinstance(index["segments"] + index["rejected"], list):
            return None
        if check_files:
            for name, size in index["files"].items():
                if (folder / name).stat().st_size != size:
                    return None
        return index
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _install(tmp: Path, folder: Path, recording: Path, inputs: dict[str, Any]) -> None:
    """Move a finished cut into place (replacing an incomplete one, with a clip deleted, say), then
    remove the recording's cuts of other ``inputs`` (an earlier recording or subtitle file) or by
    an earlier `SEGMENTS_VERSION`; cuts of the same inputs with other settings stay: another run may
    be reading them."""
    if _read_index(folder, recording) is not None:
        return  # another process has just put the same cut there: use it
    old = None
    if folder.exists():
        old = folder.with_name(f".{folder.name}.old-{uuid.uuid4().hex[:8]}")
        try:
            os.replace(folder, old)
        except FileNotFoundError:  # another process moved it first
            old = None
        if old is not None and _read_index(old, recording) is not None:
            # Another process installed a good cut between the check and the move: put it back.
            with contextlib.suppress(OSError):  # unless yet another one is in place already
                os.replace(old, folder)
                old = None
    try:
        if old is not None or not folder.exists():
            os.replace(tmp, folder)
    except OSError:
        if _read_index(folder, recording) is None:  # not another process's identical cut: a real failure
            raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    tag = folder.name.split("-", 1)[0]
    for other in folder.parent.glob(f"{tag}-*"):
        # The tag is a short hash: only folders whose segments.json names this recording, cut from other inputs.
        index = _read_index(other, recording, check_files=False) if other != folder and other.is_dir() else None
        if index is not None and (index.get("inputs") != inputs or index.get("version", 0) < SEGMENTS_VERSION):
            shutil.rmtree(other, ignore_errors=True)


def cut_subtitled(
    manifest: ManifestResult,
    segments_dir: str | os.PathLike,
    *,
    target_seconds: float = 10.0,
    max_duration: float = math.inf,
    encoding: str | None = None,
) -> tuple[ManifestResult, list[Segment]]:
    """Replace every subtitled record by the clips cut from it; the others pass through in order.

    Cues merge up to ``target_seconds`` and never past ``max_duration``; a cue longer than
    ``max_duration`` is rejected (``too_long``) without being cut. A cue that cannot be used is
    rejected (``malformed_entry``); both name the subtitle file and line. A subtitle file that
    cannot be read, or has no usable cue, rejects its recording. Returns the new manifest and every
    segment.
    """
    segments_dir = Path(segments_dir)
    records: list[ClipRecord] = []
    rejected = list(manifest.rejected)
    all_segments: list[Segment] = []
    settings = {  # floats: 30 and 30.0 make one key
        "target_seconds": float(target_seconds),
        "max_duration": float(max_duration),
        "max_merge_gap": MAX_MERGE_GAP,
        "encoding": encoding,
    }
    for record in manifest.records:
        subs = record.subtitles
        if subs is None:
            records.append(record)
            continue

        def reject(detail: str, reason: str = "malformed_entry") -> None:
            rejected.append(Rejection(record.source, str(record.audio), reason, detail))

        problems: list[SubtitleError] = []
        try:
            cues = parse_subtitles(subs, encoding, problems)
            inputs = _inputs(record, subs)
            folder = segments_dir / _folder_name(record, subs, settings, inputs)
        except (SubtitleError, ManifestEncodingError) as exc:
            reject(str(exc))
            continue
        except OSError as exc:
            reject(f"{exc.filename}: {exc.strerror}", "missing_file")
            continue
        for problem in problems:
            reject(str(problem))
        if not cues:
            reject(f"{subs}: no usable cue")
            continue
        index = _read_index(folder, record.audio)
        if index is None:
            with staged_directory(folder) as tmp:
                try:
                    cut, cut_rejected, files = _cut(record, subs, cues, target_seconds, max_duration, tmp)
                except (sf.SoundFileError, RuntimeError) as exc:
                    reject(str(exc), "unreadable_audio")
                    continue
                index = {
                    "version": SEGMENTS_VERSION,
                    "recording": str(record.audio),
                    "inputs": inputs,
                    "segments": [asdict(s) for s in cut],
                    "rejected": cut_rejected,
                    "files": files,
                }
                atomic_write_json(tmp / "segments.json", index)
                _install(tmp, folder, record.audio, inputs)
        for reason, detail in index["rejected"]:
            reject(detail, reason)
        for seg in (Segment(**s) for s in index["segments"]):
            seg = replace(seg, audio=str(folder / seg.audio), speaker=seg.speaker or record.speaker)
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
