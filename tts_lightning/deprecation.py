"""Old import paths that keep working, with a warning, for one release after a name moved."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def moved(module: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``module`` resolving each old name to its new ``"pkg.mod:attr"``."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        target_module, _, attr = names[name].partition(":")
        warnings.warn(
            f"{module}.{name} moved to {target_module}.{attr}; the old path goes away in the next release",
            FutureWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(target_module), attr)

    return __getattr__
