"""File fingerprints remembered by size and modification time (``<cache_dir>/fingerprints.json``).

Hashing a multi-gigabyte checkpoint takes seconds to minutes; the memo lets a run hash each file
once, and again only when its size or modification time changes. The codec cache names its folder
by the speech tokenizer's fingerprint, the speaker table its file by the speaker encoder's.

The ranks of a run fill one memo at once. An update takes a file lock (``fingerprints.json.lock``,
`filelock`; where the file system has no ``flock``, filelock falls back to a lock file of its own),
reads the memo, merges its entries and writes the memo beside it before renaming it into place: no
entry another process wrote is lost, and a reader never sees half a file. Reading takes no lock.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from filelock import FileLock

from tts_lightning.files import WriteError, atomic_write_json, sha256_file

MEMO_NAME = "fingerprints.json"
_ID_LENGTH = 16


def fingerprint_memo(cache_dir: str | os.PathLike) -> Path:
    """The memo of the cache folder ``cache_dir``."""
    return Path(cache_dir) / MEMO_NAME


def fingerprint_files(paths: Sequence[str | os.PathLike], memo_path: str | os.PathLike | None = None) -> str:
    """sha256 over the contents of ``paths`` (in order), short hex.

    With ``memo_path``, each file's digest is remembered there against its size and modification
    time, so a multi-gigabyte checkpoint is hashed once, not on every run.
    """
    memo_file = Path(memo_path) if memo_path is not None else None
    memo = {} if memo_file is None else read_memo(memo_file)
    changed: dict = {}
    outer = hashlib.sha256()
    for p in paths:
        p = Path(p).resolve()
        st = p.stat()
        stamp = [st.st_size, st.st_mtime_ns]
        entry = memo.get(str(p))
        if entry is not None and entry.get("stamp") == stamp:
            digest = entry["sha256"]
        else:
            digest = sha256_file(p)
            changed[str(p)] = {"stamp": stamp, "sha256": digest}
        outer.update(f"{p.name}:{digest}\n".encode())
    if memo_file is not None and changed:
        update_memo(memo_file, changed)
    return outer.hexdigest()[:_ID_LENGTH]


def memoized_by_stat(
    memo_path: str | os.PathLike, name: str, files: Sequence[str | os.PathLike], compute: Callable[[], str]
) -> str:
    """``compute()``, remembered in ``memo_path`` under ``name`` for as long as ``files`` keep
    their size and modification time."""
    memo_file = Path(memo_path)
    stamp = []
    for p in files:
        st = Path(p).stat()
        stamp.append([str(Path(p).resolve()), st.st_size, st.st_mtime_ns])
    entry = read_memo(memo_file).get(name)
    if isinstance(entry, dict) and entry.get("stamp") == stamp:
        return entry["value"]
    value = compute()
    update_memo(memo_file, {name: {"stamp": stamp, "value": value}})
    return value


def read_memo(path: Path) -> dict:
    """The memo at ``path``; empty when it is missing or unreadable (then it is rebuilt)."""
    try:
        memo = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return memo if isinstance(memo, dict) else {}


def update_memo(path: Path, entries: dict) -> None:
    """Write ``entries`` into the memo at ``path``, under its lock: read, merged, written beside it
    and renamed into place, so an entry another process wrote meanwhile stays."""
    lock = FileLock(f"{path}.lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except OSError as exc:  # a full disk or an unwritable folder: one clear error, as any write of ours
        raise WriteError(lock.lock_file, exc) from exc
    try:
        atomic_write_json(path, {**read_memo(path), **entries})
    finally:
        lock.release()
