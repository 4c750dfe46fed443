"""Progress of the codec encoding: clips, seconds of audio and an ETA.

On a terminal one line is redrawn in place (a bar); in a log (CI, a file, a notebook's captured
output) a plain line is written about every 10% and at the end, so logs stay short and readable.
Only global rank 0 shows anything.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from lightning.pytorch.utilities import rank_zero_info, rank_zero_only

BAR_WIDTH = 24


def _clock(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class EncodeProgress:
    """A `tts_lightning.data.codec_cache.Progress` callback: ``progress(clips done, clips to do,
    seconds done, seconds to do)``. ``stream`` None: standard error; it is a terminal when its
    ``isatty()`` says so."""

    def __init__(self, label: str = "encoded", stream: TextIO | None = None) -> None:
        self.label = label
        self.stream = stream
        self.start = time.monotonic()
        self._first: tuple[float, float] | None = None  # (time, seconds done) at the first update
        self._last_tenth = -1

    @property
    def _out(self) -> TextIO:
        return self.stream if self.stream is not None else sys.stderr

    def line(self, done: int, todo: int, seconds: float, total: float) -> str:
        now = time.monotonic()
        elapsed = now - self.start
        # The rate since the first update: the first batch also paid for loading the tokenizer.
        if self._first is None:
            self._first = (now, seconds)
        t0, s0 = self._first
        eta: float | None
        if seconds > s0 and now > t0:
            eta = (now - t0) * (total - seconds) / (seconds - s0)
        else:
            eta = elapsed * (total - seconds) / seconds if seconds > 0 else None
        when = f"{_clock(elapsed)} elapsed" if done >= todo else f"ETA {_clock(eta) if eta is not None else '?'}"
        return f"{self.label} {done}/{todo} clips, {seconds:.1f}/{total:.1f} s of audio, {when}"

    @rank_zero_only
    def __call__(self, done: int, todo: int, seconds: float, total: float) -> None:
        text = self.line(done, todo, seconds, total)
        out = self._out
        if getattr(out, "isatty", lambda: False)():
            filled = int(BAR_WIDTH * seconds / total) if total > 0 else BAR_WIDTH
            out.write(f"\r[{'#' * filled}{'-' * (BAR_WIDTH - filled)}] {text}\033[K")
            if done >= todo:
                out.write("\n")
            out.flush()
            return
        tenth = 10 * done // max(todo, 1)
        if tenth != self._last_tenth or done >= todo:
            self._last_tenth = tenth
            rank_zero_info(text)
