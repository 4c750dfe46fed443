"""Writing files and folders so that a crash never leaves half of one where a reader looks.

A write that fails because the disk is full, the quota is spent, or the folder is not writable
raises `WriteError` (an `OSError` with the same errno): one message naming the path, the problem
and the free space there, with nothing half-written left behind. Everything written before it stays,
so running the same command again after freeing space continues where it stopped.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
ACCESS_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # the largest unit: 2048.0 GiB, not 2.0 TiB


def file_in_the_way(path: str | os.PathLike) -> Path | None:
    """The file (not folder) that ``path`` or one of its parents is, which would keep a folder from
    being made there; None when there is none."""
    path = Path(path).expanduser()
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    return existing if existing is not None and not existing.is_dir() else None


def free_space(path: str | os.PathLike) -> int | None:
    """Free bytes (for an unprivileged user) on the file system that holds ``path`` or, when it does
    not exist yet, its nearest existing parent; None when that cannot be read."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


class WriteError(OSError):
    """A file or folder that could not be written: disk full, quota, permission, read-only.

    ``str()`` is one message for the user: the path, the problem, the free space there, how much
    the write (``needed``) or the rest of the job (``remaining``) needs where known, and what to do.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        cause: OSError,
        *,
        free: int | None = None,
        needed: int | None = None,
        written: int | None = None,
        remaining: str | None = None,
    ) -> None:
        super().__init__(cause.errno, cause.strerror or str(cause), str(path))
        self.path = Path(path)
        self.cause = cause
        self.free = free_space(path) if free is None else free
        self.needed = needed
        self.written = written
        self.remaining = remaining

    def __reduce__(self):  # crosses process boundaries (DataLoader workers, Ray) intact
        return (
            _rebuild_write_error,
            (str(self.path), self.errno, self.strerror, self.free, self.needed, self.written, self.remaining),
        )

    @property
    def disk_full(self) -> bool:
        return self.errno in SPACE_ERRNOS

    def with_remaining(self, remaining: str) -> WriteError:
        """The same error, also saying what the rest of the job needs (e.g. "23 clips still to
        encode, about 4.1 MiB")."""
        return WriteError(
            self.path, self.cause, free=self.free, needed=self.needed, written=self.written, remaining=remaining
        )

    def __str__(self) -> str:
        if self.disk_full:
            problem = "no space left on device" if self.errno == errno.ENOSPC else (self.strerror or "").lower()
        elif self.errno == errno.EROFS:
            problem = "read-only file system"
        elif self.errno in ACCESS_ERRNOS:
            problem = "permission denied"
        else:
            problem = self.strerror or str(self.cause)
        parts = [f"cannot write {self.path}: {problem}"]
        facts = []
        if self.free is not None:
            facts.append(f"{format_bytes(self.free)} free there")
        if self.needed is not None:
            facts.append(f"this write needs {format_bytes(self.needed)}")
        elif self.written:
            facts.append(f"{format_bytes(self.written)} written before it failed")
        if self.remaining:
            facts.append(self.remaining)
        if facts:
            parts.append(f" ({'; '.join(facts)})")
        if self.disk_full:
            parts.append(
                ". Free some space (or write elsewhere) and run the same command again: "
                "everything finished so far is kept and nothing half-written was left"
            )
        elif self.errno in ACCESS_ERRNOS:
            parts.append(". Choose a folder you can write to, or fix its permissions")
        return "".join(parts)


_RUST_IO_ERROR = re.compile(r"\(os error (\d+)\)")


def storage_error(exc: BaseException) -> OSError | None:
    """The disk-full or permission `OSError` behind ``exc``, or None. Writers wrap it: torch.save
    raises a RuntimeError whose context is the OSError; safetensors (Rust) raises its own error
    whose text ends in "(os error 28)"."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in SPACE_ERRNOS | ACCESS_ERRNOS:
            return current
        match = _RUST_IO_ERROR.search(str(current)) if not isinstance(current, OSError) else None
        if match and int(match.group(1)) in SPACE_ERRNOS | ACCESS_ERRNOS:
            code = int(match.group(1))
            return OSError(code, os.strerror(code))
        current = current.__cause__ or current.__context__
    return None


def _rebuild_write_error(path, code, strerror, free, needed, written, remaining) -> WriteError:
    return WriteError(path, OSError(code, strerror), free=free, needed=needed, written=written, remaining=remaining)


def _as_write_error(exc: BaseException, path: Path, **facts) -> BaseException:
    if isinstance(exc, WriteError):
        return exc
    cause = storage_error(exc)
    return exc if cause is None else WriteError(path, cause, **facts)


def _size(path: Path) -> int:
    try:
        if path.is_dir():
            return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        return path.stat().st_size
    except OSError:
        return 0


def _umask() -> int:
    try:  # Linux: read it without changing it (other threads may be creating files)
        with open("/proc/self/status", encoding="ascii") as fh:
            return next(int(line.split()[1], 8) for line in fh if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)  # elsewhere, the only way to read it; set back at once
        os.umask(mask)
        return mask


def _follow_umask(apply: Callable[[int], None], mode: int) -> None:
    """mkstemp makes 0600 files and mkdtemp 0700 folders: a cache or an export shared with other
    users must stay readable to them. A file system without permissions (some CIFS/FUSE mounts)
    refuses the chmod; what it shows then is its own business."""
    with contextlib.suppress(OSError):
        apply(mode & ~_umask())


def atomic_write(
    path: str | os.PathLike, write: Callable[[Any], None], *, binary: bool = True, needed: int | None = None
) -> Path:
    """Write ``path`` through ``write(fileobj)`` into a temporary file beside it, then rename it into
    place, so a reader (or a crash) never sees half a file. A full disk or a folder that cannot be
    written raises `WriteError` (``needed``: the bytes this file takes, when the caller knows)."""
    path = Path(path)
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        _follow_umask(lambda mode: os.fchmod(fd, mode), 0o666)
        with os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8") as fh:
            write(fh)
        os.replace(tmp, path)
    except BaseException as exc:
        written = _size(Path(tmp)) if tmp else None
        if tmp:
            Path(tmp).unlink(missing_ok=True)
        error = _as_write_error(exc, path, needed=needed, written=written)
        if error is exc:
            raise
        raise error from exc
    return path


def atomic_write_wav(path: str | os.PathLike, audio: Any, sample_rate: int, *, subtype: str | None = None) -> Path:
    """Write ``audio`` (samples, or samples x channels) as a WAV file through `atomic_write`: a
    full disk raises `WriteError` and leaves neither a partial file nor the temporary one. The file
    is encoded in memory first (audio clips are small), so the disk sees plain writes whose errors
    are OSErrors (libsndfile writing to a file itself reports a full disk in its own words)."""
    import io

    import soundfile as sf

    buffer = io.BytesIO()
    sf.write(buffer, audio, int(sample_rate), subtype=subtype, format="WAV")
    data = buffer.getvalue()
    return atomic_write(path, lambda fh: fh.write(data), needed=len(data))


def atomic_write_json(path: str | os.PathLike, data: object) -> Path:
    def _write(fh) -> None:
        json.dump(data, fh, indent=2, ensure_ascii=False)
        fh.write("\n")

    return atomic_write(path, _write, binary=False)


@contextmanager
def staged_directory(out: Path, *, needed: int | None = None) -> Iterator[Path]:
    """A temporary folder beside ``out`` to build in; the caller renames it into place. Whatever is
    left of it afterwards (an error, an interruption) is removed. A full disk or an unwritable
    folder while building raises `WriteError` naming ``out`` (``needed``: the bytes the folder
    takes, when the caller knows)."""
    out = Path(out)
    tmp: Path | None = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        _follow_umask(tmp.chmod, 0o777)
        yield tmp
    except BaseException as exc:
        written = _size(tmp) if tmp is not None else None
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        error = _as_write_error(exc, out, needed=needed, written=written)
        if error is exc:
            raise
        raise error from exc
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)  # nothing left once it was renamed


def recover_beside(out: Path) -> None:
    """What a killed build or replacement of the folder ``out`` left beside it (`staged_directory`,
    `replace_directory`; SIGKILL runs no cleanup): an old folder set aside whose replacement never
    moved in goes back to ``out``; the rest (staging folders, set-aside copies) is removed. For a
    command that is the only writer of ``out`` (export)."""
    out = Path(out)
    if not out.parent.is_dir():
        return
    prefix = f".{out.name}."
    # mkdtemp's names exactly (8 characters of its alphabet): ".voice.v2.k3j2h1g0" is voice.v2's, not voice's.
    ours = re.compile(re.escape(prefix) + r"(old-)?[a-z0-9_]{8}")
    leftovers = [p for p in out.parent.iterdir() if ours.fullmatch(p.name) and p.is_dir() and not p.is_symlink()]
    for old in sorted(p for p in leftovers if p.name.startswith(f"{prefix}old-")):
        if not out.exists() and (old / out.name).is_dir():
            os.replace(old / out.name, out)
    for leftover in leftovers:
        shutil.rmtree(leftover, ignore_errors=True)


def replace_directory(staged: Path, out: Path) -> None:
    """Put the built folder ``staged`` (`staged_directory`) at ``out``, replacing what is there: the
    old folder is renamed aside first, put back if the new one cannot move in, and removed only
    once it has (a kill between the renames leaves it whole as ``.<name>.old-*/<name>``)."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / out.name)
    try:
        os.replace(staged, out)
    except BaseException:
        if old is not None and not out.exists():
            os.replace(old / out.name, out)  # the old one back where it was
            old.rmdir()
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_safetensors(tensors: dict[str, Any], path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' ``save_file``, readable as the umask allows (it creates its files 0600, so a
    model exported for another account, e.g. a server's, could not be read there)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    _follow_umask(Path(path).chmod, 0o666)


def remove_stale_temporaries(folder: str | os.PathLike, pattern: str, older_than: float = 3600.0) -> list[Path]:
    """Remove the temporary files (``pattern``, e.g. ``.*.tmp``) a killed writer left in ``folder``,
    those older than ``older_than`` seconds (never one being written now); return them."""
    removed = []
    now = time.time()
    for tmp in sorted(Path(folder).glob(pattern)):
        with contextlib.suppress(FileNotFoundError):
            if now - tmp.stat().st_mtime > older_than:
                tmp.unlink()
                removed.append(tmp)
    return removed


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()
