"""Writing files and folders so that a crash never leaves half of one where a reader looks."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def atomic_write(path: str | os.PathLike, write: Callable[[object], None], *, binary: bool = True) -> Path:
    """Write ``path`` through ``write(fileobj)`` into a temporary file beside it, then rename it into
    place, so a reader (or a crash) never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as fh:
            write(fh)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_json(path: str | os.PathLike, data: object) -> Path:
    def _write(fh) -> None:
        json.dump(data, fh, indent=2, ensure_ascii=False)
        fh.write("\n")

    return atomic_write(path, _write, binary=False)


@contextmanager
def staged_directory(out: Path) -> Iterator[Path]:
    """A temporary folder beside ``out`` to build in; the caller renames it into place. Whatever is
    left of it afterwards (an error, an interruption) is removed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing left once it was renamed


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()
