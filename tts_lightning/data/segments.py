"""Long recordings with subtitles -> clips, cut at the subtitle timestamps.

A manifest entry (or folder item) whose audio has an ``.srt`` or ``.vtt`` file beside it (same
stem) and no transcript of its own is a long recording: `cut_subtitled` replaces it by one clip per
cue, or per run of adjacent cues merged up to ``target_seconds`` (and ``max_duration``). The cues,
their speakers and which of them merge come from `tts_lightning.data.subtitles`. Cues are never
merged across a speaker change, across a gap of more than `MAX_MERGE_GAP` seconds, or with a cue
whose text is empty after markup is removed (that one becomes a clip of its own, which validation
then rejects as ``empty_transcript``).

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
import json
import math
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf

from tts_lightning.data.manifest import ClipRecord, ManifestEncodingError, ManifestResult, Rejection
from tts_lightning.data.subtitles import MAX_MERGE_GAP, Cue, SubtitleError, merge_cues, parse_subtitles
from tts_lightning.files import WriteError, atomic_write_json, staged_directory

SEGMENTS_VERSION = 3
_BLOCK_FRAMES = 1 << 16  # frames decoded at a time while cutting


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


def _past_end(subtitles: Path, cue: Cue, frames: int, rate: int) -> tuple[str, str]:
    return (
        "malformed_entry",
        f"{subtitles}:{cue.line}: cue {cue.number} starts at {cue.start:.3f} s, "
        f"after the end of the recording ({frames / rate:.3f} s)",
    )


def _groups(
    subtitles: Path, cues: list[Cue], target_seconds: float, max_duration: float, rate: int, frames: int
) -> tuple[list[list[Cue]], list[tuple[int, int]], list[tuple[str, str]]]:
    """The clips to cut from a recording of ``frames`` at ``rate``: (the cues of each, its span in
    frames, (reason, detail) of each cue rejected)."""
    # Cues past the end (as the header tells it) are left out before merging, so that no clip
    # holds the text of a cue without its audio.
    inside = [cue for cue in cues if round(cue.start * rate) < frames]
    rejected = [_past_end(subtitles, cue, frames, rate) for cue in cues if round(cue.start * rate) >= frames]
    groups: list[list[Cue]] = []
    spans: list[tuple[int, int]] = []
    for group in ([inside[k] for k in indices] for indices in merge_cues(inside, min(target_seconds, max_duration))):
        span = (round(group[0].start * rate), round(group[-1].end * rate))
        seconds = (min(span[1], frames) - span[0]) / rate
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
    return groups, spans, rejected


def _write_clips(
    f: sf.SoundFile, dtype: str, subtype: str, spans: list[tuple[int, int]], paths: list[Path], folder: Path
) -> tuple[dict[int, int], int]:
    """Write the frames of each span of ``f`` into its path, in one decoding pass: each clip is
    written while the pass crosses its span (spans may overlap). Returns ({clip: its last frame},
    the frames decoded); a clip the recording ended before is missing."""
    waiting = sorted(range(len(spans)), key=lambda j: spans[j][0])[::-1]  # next to open last
    open_: dict[int, sf.SoundFile] = {}
    ends: dict[int, int] = {}
    total = 0
    try:
        for position, block in _decode(f, dtype):
            total = position + len(block)
            with _writing(folder):
                while waiting and spans[waiting[-1]][0] < total:
                    j = waiting.pop()
                    open_[j] = sf.SoundFile(paths[j], "w", f.samplerate, f.channels, subtype, format="WAV")
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
    return ends, total


def _cut(
    record: ClipRecord, subtitles: Path, cues: list[Cue], target_seconds: float, max_duration: float, folder: Path
) -> tuple[list[Segment], list[tuple[str, str]], dict[str, int]]:
    """Cut the clips into ``folder``: (segments, (reason, detail) of each cue rejected, {clip file:
    bytes})."""
    with sf.SoundFile(record.audio) as f:
        subtype, dtype = _write_format(f)
        rate = f.samplerate
        groups, spans, rejected = _groups(subtitles, cues, target_seconds, max_duration, rate, f.frames)
        names = [f"{record.audio.stem}_{n:04d}.wav" for n in range(1, len(groups) + 1)]
        ends, total = _write_clips(f, dtype, subtype, spans, [folder / name for name in names], folder)
    segments: list[Segment] = []
    for j, group in enumerate(groups):
        if j not in ends:  # the recording decoded shorter than its header said
            rejected += [_past_end(subtitles, cue, total, rate) for cue in group]
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


def _cut_record(
    record: ClipRecord,
    segments_dir: Path,
    settings: dict[str, Any],
    limits: tuple[float, float],
    reject: Callable[[str, str], None],
) -> tuple[Path, dict[str, Any]] | None:
    """The cut of a subtitled record: its folder and segments.json, cut now unless an earlier run
    left it; None when the record is rejected (``reject(detail, reason)``; so is each unusable cue).
    ``settings``: what the cut depends on (its folder's key); ``limits``: target_seconds and
    max_duration as given."""
    subs = record.subtitles
    assert subs is not None
    problems: list[SubtitleError] = []
    try:
        cues = parse_subtitles(subs, settings["encoding"], problems)
        inputs = _inputs(record, subs)
        folder = segments_dir / _folder_name(record, subs, settings, inputs)
    except (SubtitleError, ManifestEncodingError) as exc:
        reject(str(exc), "malformed_entry")
        return None
    except OSError as exc:
        reject(f"{exc.filename}: {exc.strerror}", "missing_file")
        return None
    for problem in problems:
        reject(str(problem), "malformed_entry")
    if not cues:
        reject(f"{subs}: no usable cue", "malformed_entry")
        return None
    index = _read_index(folder, record.audio)
    if index is None:
        with staged_directory(folder) as tmp:
            try:
                cut, cut_rejected, files = _cut(record, subs, cues, *limits, tmp)
            except (sf.SoundFileError, RuntimeError) as exc:
                reject(str(exc), "unreadable_audio")
                return None
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
    return folder, index


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
        if record.subtitles is None:
            records.append(record)
            continue

        def reject(detail: str, reason: str) -> None:
            rejected.append(Rejection(record.source, str(record.audio), reason, detail))

        cut = _cut_record(record, Path(segments_dir), settings, (target_seconds, max_duration), reject)
        if cut is None:
            continue
        folder, index = cut
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
