"""Locate the small two-speaker demo dataset shipped inside the package."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def demo_dir() -> Path:
    """The shipped `tts_lightning/demo` folder (clips/<speaker>/<id>.flac + .txt, train.jsonl)."""
    root = files("tts_lightning") / "demo"
    # Training code needs real file paths; a zipped install would give a non-filesystem Traversable.
    path = Path(str(root))
    if not path.is_dir():
        raise FileNotFoundError(f"demo dataset folder not found at {path}; is tts_lightning installed from a zip?")
    return path


def demo_manifest() -> Path:
    """The demo's Qwen3-TTS JSONL manifest (relative paths into clips/)."""
    path = demo_dir() / "train.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"demo manifest missing: {path}")
    return path
