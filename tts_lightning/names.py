"""Names in one-line messages: the first few of a long list, and the name a mistyped one most
likely meant (a run of 100 speakers would otherwise put 100 names in one error line)."""

from __future__ import annotations

import difflib
from collections.abc import Sequence

__all__ = ["some_names", "unknown_names"]


def some_names(names: Sequence[str], shown: int = 8) -> str:
    """The first ``shown`` of ``names``, the rest counted: "a, b, c and 92 more"."""
    names = list(names)
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def unknown_names(unknown: Sequence[str], known: Sequence[str]) -> str:
    """``unknown`` quoted, each with the ``known`` name it most likely meant (the same name in
    another case, else the closest spelling): "'Alice' (did you mean 'alice'?), 'zed'"."""
    return ", ".join(_with_guess(name, known) for name in unknown)


def _with_guess(name: str, known: Sequence[str]) -> str:
    same_letters = [k for k in known if k.lower() == name.lower()]
    guess = same_letters or difflib.get_close_matches(name, list(known), n=1)
    return f"{name!r} (did you mean {guess[0]!r}?)" if guess else repr(name)
