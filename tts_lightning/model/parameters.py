"""Which parameters train: the default frozen modules and the name patterns that select parameters.

Kept free of Lightning so that the memory planner and the benchmarks can match names cheaply.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

# The speaker encoder makes the speaker rows; they are computed once per speaker, so it never trains.
DEFAULT_FREEZE = ("speaker_encoder",)


def matches(name: str, patterns: Sequence[str]) -> bool:
    """A parameter name matches a pattern naming it, a module above it, or a glob over it."""
    return any(name == p or name.startswith(p + ".") or fnmatch.fnmatchcase(name, p) for p in patterns)
