"""Which parameters train: the default frozen modules and the name patterns that select parameters.

Kept free of Lightning so that the memory planner and the benchmarks can match names cheaply.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import Any

# The speaker encoder makes the speaker rows; they are computed once per speaker, so it never trains.
DEFAULT_FREEZE = ("speaker_encoder",)


def matches(name: str, patterns: Sequence[str]) -> bool:
    """A parameter name matches a pattern naming it, a module above it, or a glob over it."""
    return any(name == p or name.startswith(p + ".") or fnmatch.fnmatchcase(name, p) for p in patterns)


def absent_speaker_encoder(globs: Sequence[str], model: Any) -> bool:
    """FSDP2's default ``speaker_encoder`` group on a model without one (a custom_voice model): a
    group to leave out, not an error (FSDP2 and its memory planner both ask)."""
    return tuple(globs) == ("speaker_encoder",) and getattr(model, "speaker_encoder", 1) is None
