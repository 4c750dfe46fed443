"""Read a YAML config file, with errors that name the file and the line (jsonargparse names a
syntax error's place as ``"<unicode string>"``)."""

from __future__ import annotations

import os
from typing import Any

from tts_lightning.errors import ConfigError


def load_yaml_config(path: str | os.PathLike) -> Any:
    """The parsed YAML of ``path``; a missing file, non-UTF-8 text or bad YAML is a `ConfigError`."""
    import yaml

    if not os.path.isfile(path):
        raise ConfigError(f"config {path} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or " ".join(str(exc).split())
        raise ConfigError(f"config {path} is not valid YAML{where}: {problem}") from None
