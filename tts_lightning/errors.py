"""What the user asked for cannot be done as asked: one message, no traceback.

`UserError` is the project's type for such problems (a missing or unreadable file, an unknown
speaker, a setting's value the code refuses); its ``str()`` names the file or the setting and says
what to do. The `tts-lightning` entry point reports every command's errors in one place
(`report_errors`, which asks `explain`): a user error is printed as
``tts-lightning <command>: error: <message>`` with exit status 2, a failed write
(`tts_lightning.files.WriteError`: disk full, permissions) with exit status 1, and anything else
keeps its traceback, since it is a bug. ``TTS_LIGHTNING_TRACEBACK=1`` shows the traceback of every
error.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

USAGE = 2  # exit status of a user error, as argparse's usage errors
FAILED = 1  # exit status of a write the file system refused (the same command works once it is fixed)

_PACKAGE = Path(__file__).resolve().parent
# Code whose checks still raise plain ValueError / FileNotFoundError / FileExistsError: such an error
# raised by a `raise` statement of these folders is a user error too (the data side checks the
# user's clips and settings; the memory planner reads the user's config; the samples callback checks
# its YAML arguments).
_UNTYPED_CHECKS = tuple(_PACKAGE / folder for folder in ("data", "distributed/memory", "callbacks"))
_UNTYPED_TYPES = (ValueError, FileNotFoundError, FileExistsError)


STOPPED_BY_SIGTERM = 143  # 128 + SIGTERM: what a shell reports for a process that SIGTERM ended
STOPPED_BY_CTRL_C = 130  # 128 + SIGINT


class UserError(Exception):
    """A problem with what the user asked for, which the user fixes; not a bug."""


class ConfigError(UserError, ValueError):
    """A setting (a command-line option or a config entry) whose value the code refuses."""


def _causes(exc: BaseException):
    """``exc`` and the errors it was raised from (``raise ... from``), outermost first. Not the
    implicit context: an error raised while handling another one is a failure of its own."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__


def _raised_by_an_untyped_check(exc: BaseException) -> bool:
    if not isinstance(exc, _UNTYPED_TYPES) or exc.__traceback__ is None:
        return False
    origin = traceback.extract_tb(exc.__traceback__)[-1]  # where it was raised first
    path = Path(origin.filename).resolve()
    return (origin.line or "").startswith("raise ") and any(path.is_relative_to(d) for d in _UNTYPED_CHECKS)


def _is_lightning_misconfiguration(exc: BaseException) -> bool:
    # Lightning's own check of the Trainer's settings (an accelerator this machine lacks, ...).
    return any(c.__name__ == "MisconfigurationException" for c in type(exc).__mro__)


def explain(exc: BaseException) -> tuple[str, int] | None:
    """The message and exit status for ``exc`` when it is a user error or a refused write (itself
    or an error it was raised from: LightningCLI wraps what a link's ``compute_fn`` raises); None
    for a bug."""
    from tts_lightning.files import WriteError

    for error in _causes(exc):
        if isinstance(error, WriteError):
            return str(error), FAILED
        if isinstance(error, UserError) or _is_lightning_misconfiguration(error) or _raised_by_an_untyped_check(error):
            return str(error), USAGE
    return None


def report_errors(command: str, run: Callable[[], int]) -> int:
    """``run()`` (a command, returning its exit status); a user error or a refused write ends in
    one message on stderr, ``tts-lightning <command>: error: ...``, and its exit status (`explain`);
    any other error propagates with its traceback. ``TTS_LIGHTNING_TRACEBACK=1``: every error does."""
    try:
        return run()
    except Exception as exc:
        explained = explain(exc)
        if explained is None or os.environ.get("TTS_LIGHTNING_TRACEBACK", "") not in ("", "0"):
            raise
        message, status = explained
        print(f"tts-lightning {command}: error: {message}", file=sys.stderr)
        return status
