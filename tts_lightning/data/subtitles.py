"""Subtitle files (SRT, WebVTT) -> cues: timing, plain text and speaker, or why a cue cannot be used.

A long recording with an ``.srt`` or ``.vtt`` file beside it (same stem) and no transcript of its
own is cut at the cues (`tts_lightning.data.segments`); this file reads the cues and decides which
to merge into one clip (`merge_cues`).

Speakers: in WebVTT only a ``<v Name>`` voice tag names the speaker (the format's own way); in SRT
an upper-case ``NAME:`` at the start of a line does (``JOHN: Hi``, ``- JOHN: Hi``), except a word
such as ``NOTE:`` or ``WARNING:`` that labels the text rather than a person (`NOT_SPEAKERS`). An
unlabelled cue continues the previous cue's speaker. A cue with lines by two speakers (two
labels, or dialogue dashes with one labelled line) cannot be cut apart and is rejected; dialogue
dashes without labels are kept as one text.

Text: markup is removed (tags starting with a letter or ``/``, WebVTT timestamps ``<00:01.000>``,
ASS overrides ``{\\an8}``; a bare ``<`` is text), then HTML entities are decoded (``&amp;``) and
whitespace is collapsed. A text block after a blank line inside a cue continues that cue's text.

Nothing is dropped silently: a cue that cannot be used (bad or zero-length timing, two speakers)
is reported naming the subtitle file and line, and the other cues are still read.

Why our own parser, not a library: ``srt`` (3.5) and ``webvtt-py`` (0.6) were tried on every case
the tests cover. ``srt`` reads lone cue numbers and blank lines inside a cue's text well, but it
keeps no line numbers, and a cue whose timing is broken either fails the whole file (with a
character offset) or is skipped with only a log warning, so a cue cannot be rejected alone naming
its file and line; it also reads ``00:01,000`` (minutes and seconds) as one minute, a fraction
``,5`` as 5 ms, and a second timing glued into a cue's text as text. ``webvtt-py`` gives voices,
but drops a cue with a broken timing and a text block after a blank line without a word, strips
markup by removing everything between ``<`` and ``>`` (``5 < 10 and <i>x</i>`` becomes ``5 x``),
leaves HTML entities encoded, gives whole seconds only (``start_in_seconds``), and names only the
first voice of a cue with two. What the libraries would take over (splitting blocks, reading a
timestamp) is the small part; the rest (line numbers, per-cue rejections, markup, speakers) would
stay ours on top of a second pass, so the parser stays ours: about a hundred lines, each case
tested in tests/data/test_subtitles.py.
"""

from __future__ import annotations

import html
import os
import re
from dataclasses import dataclass
from pathlib import Path

from tts_lightning.data.manifest import ClipRecord, ManifestEncodingError, read_text

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


def _entries(lines: list[str], vtt: bool) -> list[tuple[int, list[str]]]:
    """The cues of a file's lines as (index of the first line, lines): blocks of non-blank lines,
    a block of plain text joined to the cue before it, WebVTT's header and NOTE, STYLE and REGION
    blocks and SRT cue numbers alone left out."""
    entries: list[tuple[int, list[str]]] = []
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
    return entries


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
    cues: list[Cue] = []
    speaker = None  # the current speaker: a label marks a change of speaker

    def bad(line: int, message: str) -> None:
        error = SubtitleError(f"{path}:{line}: {message}")
        if problems is None:
            raise error
        problems.append(error)

    for number, (block_start, block) in enumerate(_entries(lines, vtt), start=1):
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
