"""Helpers that write real audio files for the data tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf


def sine(
    seconds: float | None, sr: int, *, freq: float = 220.0, amp: float = 0.3, frames: int | None = None
) -> np.ndarray:
    """A float32 sine of `frames` samples (or `seconds` long)."""
    n = frames if frames is not None else int(round(seconds * sr))
    t = np.arange(n, dtype=np.float64) / sr
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


WriteTone = Callable[..., Path]


@pytest.fixture
def make_sine() -> Callable[..., np.ndarray]:
    """make_sine(seconds, sr, freq=220, amp=0.3, frames=None) -> float32 array."""
    return sine


@pytest.fixture
def write_tone() -> WriteTone:
    """write_tone(path, seconds=1.0, sr=24000, channels=1, freq=220, amp=0.3, frames=None, subtype="PCM_16")."""

    def _write(
        path: Path,
        seconds: float = 1.0,
        sr: int = 24_000,
        channels: int = 1,
        freq: float = 220.0,
        amp: float = 0.3,
        frames: int | None = None,
        subtype: str = "PCM_16",
    ) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        mono = sine(seconds, sr, freq=freq, amp=amp, frames=frames)
        data = np.stack([mono * (1.0 if c == 0 else 0.0) for c in range(channels)], axis=1)
        sf.write(path, data, sr, subtype=subtype if path.suffix.lower() != ".ogg" else None)
        return path

    return _write
