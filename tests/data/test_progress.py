"""The codec-encoding progress: a redrawn bar on a terminal, a plain line about every 10% in a log."""

from __future__ import annotations

import io
import logging

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
