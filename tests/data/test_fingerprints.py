"""The memo of file fingerprints (fingerprints.json), which the ranks of a run fill at once."""

from __future__ import annotations

import errno
import json
import multiprocessing
from pathlib import Path

import pytest

from tts_lightning.data import fingerprints
from tts_lightning.files import WriteError


def test_the_fingerprint_memo_keeps_an_entry_written_meanwhile(tmp_path):
    """The ranks of a run fill one memo (fingerprints.json) at once: what another process wrote
    while this one was computing stays (it was lost, and hashed again on the next run)."""
    memo, a, b = tmp_path / "fingerprints.json", tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"a")
    b.write_bytes(b"b")

    def compute() -> str:  # meanwhile, another process memoises another file
        fingerprints.fingerprint_files([b], memo)
        return "value"

    assert fingerprints.memoized_by_stat(memo, "name", [a], compute) == "value"
    assert set(json.loads(memo.read_text())) == {"name", str(b.resolve())}
    assert fingerprints.memoized_by_stat(memo, "name", [a], lambda: pytest.fail("computed again")) == "value"


WRITERS, ENTRIES = 4, 40


def _add_entries(memo: str, writer: int, start) -> None:
    start.wait()  # all writers at once
    for k in range(ENTRIES):
        fingerprints.update_memo(Path(memo), {f"{writer}-{k}": {"value": k}})


def test_processes_adding_entries_at_once_lose_none(tmp_path):
    """Each update reads, merges and writes the memo under its file lock: without the lock, two
    processes that read the same memo would each write it without the other's entry."""
    memo = tmp_path / "fingerprints.json"
    ctx = multiprocessing.get_context("fork")
    start = ctx.Barrier(WRITERS, timeout=60)
    procs = [ctx.Process(target=_add_entries, args=(str(memo), w, start)) for w in range(WRITERS)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
    assert [proc.exitcode for proc in procs] == [0] * WRITERS
    entries = json.loads(memo.read_text())
    assert sorted(entries) == sorted(f"{w}-{k}" for w in range(WRITERS) for k in range(ENTRIES))
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []  # every write renamed into place


def test_a_lock_that_cannot_be_made_is_a_write_error(tmp_path, monkeypatch):
    """The lock file is written like any file of ours: no room or no right to create it is one
    clear `WriteError` naming it."""

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.lock_file))

    monkeypatch.setattr(fingerprints.FileLock, "acquire", full)
    with pytest.raises(WriteError, match=r"cannot write .*fingerprints\.json\.lock: no space left on device"):
        fingerprints.update_memo(tmp_path / "fingerprints.json", {"a": 1})
