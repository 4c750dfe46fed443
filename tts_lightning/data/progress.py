"""Progress of the codec encoding: clips, seconds of audio and an ETA, drawn by tqdm.

On a terminal one line is redrawn in place (a bar); in a log (CI, a file, a notebook's captured
output) a plain line is written about every 10% of the clips and at the end, so logs stay short
and readable. Only global rank 0 shows anything.

tqdm keeps the time, estimates the rate and the time left, formats the line and redraws it; the bar
counts seconds of audio (encoding time follows them, not the number of clips). Its rate is measured
from the first update on (``smoothing=0``: the average since then): the first batch also paid for
loading the speech tokenizer, which the first line's estimate alone includes. Its elapsed time
counts from when the progress was made, as the final line says.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, TextIO

from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from tqdm import tqdm

BAR_WIDTH = 24
_LINE = "{label} {done}/{todo} clips, {n:.1f}/{total:.1f} s of audio, "
_BAR = f"[{{bar:{BAR_WIDTH}}}] "


class _EncodeBar(tqdm):
    """tqdm over seconds of audio whose line also counts clips; ``log``: each line goes to the log
    (a tqdm front end, as its ``display`` documents) instead of being redrawn."""

    def __init__(self, *, label: str, todo: int, began: float, log: bool, **kwargs: Any) -> None:
        # Set before tqdm's __init__, which may format a line.
        self.label, self.done, self.todo, self.began, self.log = label, 0, todo, began, log
        super().__init__(**kwargs)

    @property
    def format_dict(self) -> dict[str, Any]:
        d = super().format_dict
        now = self._time()
        if d.get("n") == d.get("initial") and d.get("n"):  # the first line: the rate since the progress was made
            d["rate"] = d["n"] / max(now - self.began, 1e-9)
        d.update(label=self.label, done=self.done, todo=self.todo, since=self.format_interval(now - self.began))
        return d

    def display(self, msg: str | None = None, pos: int | None = None) -> bool | None:
        if not self.log:
            return super().display(msg, pos)
        rank_zero_info(self.format_meter(**self.format_dict) if msg is None else msg)
        return True


class EncodeProgress:
    """A `tts_lightning.data.codec_cache.Progress` callback: ``progress(clips done, clips to do,
    seconds done, seconds to do)``. ``stream`` None: standard error; it is a terminal when its
    ``isatty()`` says so."""

    def __init__(self, label: str = "encoded", stream: TextIO | None = None) -> None:
        self.label = label
        self.stream = stream
        self.start = time.time()
        self._bar: _EncodeBar | None = None
        self._last_tenth = -1

    @property
    def _out(self) -> TextIO:
        return self.stream if self.stream is not None else sys.stderr

    def _open(self, todo: int, seconds: float, total: float) -> _EncodeBar:
        out = self._out
        terminal = bool(getattr(out, "isatty", lambda: False)())
        return _EncodeBar(
            label=self.label,
            todo=todo,
            began=self.start,
            log=not terminal,
            total=total,
            initial=seconds,
            file=out,
            bar_format=(_BAR if terminal else "") + _LINE + "ETA {remaining}",
            ascii="-#",  # [#####-----]: the same on every terminal and in every font
            smoothing=0,
            delay=math.inf,  # tqdm draws nothing on its own: `__call__` says when
            dynamic_ncols=terminal,
        )

    @rank_zero_only
    def __call__(self, done: int, todo: int, seconds: float, total: float) -> None:
        first = self._bar is None
        bar = self._bar = self._bar or self._open(todo, seconds, total)
        bar.done, bar.todo = done, todo
        bar.update(seconds - bar.n)
        finished = done >= todo
        if finished:  # the last line says how long it took
            bar.bar_format = bar.bar_format.replace("ETA {remaining}", "{since} elapsed")
        tenth = 10 * done // max(todo, 1)
        if first or finished or not bar.log or tenth != self._last_tenth:
            bar.refresh()
        self._last_tenth = tenth
        if finished:
            bar.close()  # draws nothing more (delay): the line stays as drawn
            if not bar.log:
                self._out.write("\n")
                self._out.flush()
