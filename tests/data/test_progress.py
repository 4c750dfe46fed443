"""The codec-encoding progress: a redrawn bar on a terminal, a plain line about every 10% in a log."""

from __future__ import annotations

import io
import logging
from types import SimpleNamespace

from tts_lightning.data.progress import EncodeProgress


def test_encode_progress_is_a_bar_on_a_terminal_and_plain_lines_in_a_log():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term = Terminal()
    bar = EncodeProgress(stream=term)
    for done in (8, 16, 24):
        bar(done, 24, done * 2.5, 60.0)
    frames = term.getvalue().split("\r")[1:]
    assert len(frames) == 3 and frames[-1].endswith("\n") and term.getvalue().count("\n") == 1
    assert frames[0].startswith("[########----------------] encoded 8/24 clips, 20.0/60.0 s of audio, ETA ")
    assert "elapsed" in frames[-1]

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addHandler(handler)
    try:
        log = EncodeProgress(stream=io.StringIO())
        for done in range(1, 101):
            log(done, 100, done * 1.0, 100.0)
    finally:
        logging.getLogger("lightning.pytorch.utilities.rank_zero").removeHandler(handler)
    assert len(lines) == 11  # about every 10%, and the end
    assert lines[0].startswith("encoded 1/100 clips, 1.0/100.0 s of audio, ETA ") and "elapsed" in lines[-1]


def test_the_eta_leaves_out_the_first_batch_and_the_last_line_counts_it(monkeypatch):
    """The first batch also paid for loading the speech tokenizer: the first line's ETA is all it
    has, later ones go by the rate since then; the last line gives the time since the start."""
    import tqdm.std

    import tts_lightning.data.progress as progress

    clock = [100.0]
    monkeypatch.setattr(tqdm.std, "time", lambda: clock[0])  # tqdm's clock
    monkeypatch.setattr(progress, "time", SimpleNamespace(time=lambda: clock[0]))
    lines: list[str] = []
    monkeypatch.setattr(progress, "rank_zero_info", lines.append)
    bar = EncodeProgress(stream=io.StringIO())
    clock[0] += 20.0  # the tokenizer loads, the first batch of 6 s of audio encodes
    bar(1, 10, 6.0, 60.0)
    for done in range(2, 11):
        clock[0] += 1.0  # then 6 s of audio a second
        bar(done, 10, done * 6.0, 60.0)
    assert lines[0].endswith("ETA 03:00")  # 54 s of audio at 6 s per 20 s
    assert lines[1] == "encoded 2/10 clips, 12.0/60.0 s of audio, ETA 00:08"  # 48 s at 6 s per second
    assert lines[-1] == "encoded 10/10 clips, 60.0/60.0 s of audio, 00:29 elapsed" and len(lines) == 10
