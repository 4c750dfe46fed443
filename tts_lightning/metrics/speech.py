"""Pace and end-of-speech: is the generated speech as fast as the speaker, and does it stop?

- **Speaking rate**: seconds of speech per character of the text (letters and digits; leading and
  trailing silence excluded, so a model that pads with silence is not counted as slow). A speaker's
  rate is measured the same way on their real clips, pooled (total speech seconds / total
  characters). ``speaking_rate_ratio`` divides a generated clip's rate by the speaker's: 1.0 is the
  speaker's pace, above 1 slower, below 1 faster (upstream issue 179: fine-tuned speech getting
  faster epoch after epoch shows as a ratio falling below 1).
- **End-of-speech failures**: a generation that never emits ``codec_eos`` runs to its
  ``max_new_tokens``. `frame_limit` sets the limit from the text's length and the speaker's pace
  (a fixed limit either cuts long texts or lets a babbling model run for minutes),
  `max_new_tokens_for` turns it into the ``max_new_tokens`` to generate with, and
  `hit_frame_limit` says whether a generation reached it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

FRAME_RATE = 12.5  # codec frames per second of the 12 Hz models
# Generous: a text may take up to this many times the speaker's own pace before it counts as a
# generation that never stopped.
DEFAULT_LIMIT_FACTOR = 3.0
DEFAULT_MIN_FRAMES = 25  # 2 s
SILENCE_DB = 35.0  # frames this far below the loudest frame are silence
WINDOW_SECONDS = 0.02


def text_characters(text: str) -> int:
    """Letters and digits of ``text`` (any script): what takes time to say."""
    return sum(1 for ch in text if ch.isalnum())


def speech_seconds(wav, sample_rate: int, silence_db: float = SILENCE_DB) -> float:
    """Seconds from the first to the last non-silent 20 ms window (windows more than ``silence_db``
    below the loudest are silent); 0 for empty or silent audio."""
    x = torch.as_tensor(np.asarray(wav, dtype=np.float32)).reshape(-1)
    window = max(1, int(round(WINDOW_SECONDS * sample_rate)))
    if x.numel() == 0:
        return 0.0
    n = math.ceil(x.numel() / window)
    x = torch.nn.functional.pad(x, (0, n * window - x.numel()))
    rms = x.reshape(n, window).pow(2).mean(1).sqrt()
    peak = float(rms.max())
    if peak <= 0:
        return 0.0
    voiced = torch.nonzero(rms >= peak * 10 ** (-silence_db / 20)).reshape(-1)
    first, last = int(voiced[0]), int(voiced[-1])
    return (last - first + 1) * window / sample_rate


def seconds_per_character(wavs: Sequence, texts: Sequence[str], sample_rate: int) -> float:
    """Pooled pace of clips with their transcripts: total speech seconds / total characters."""
    if len(wavs) != len(texts):
        raise ValueError(f"{len(wavs)} clips for {len(texts)} texts")
    chars = sum(text_characters(t) for t in texts)
    if chars == 0:
        raise ValueError("the texts hold no letters or digits: no speaking rate")
    return sum(speech_seconds(w, sample_rate) for w in wavs) / chars


def speaking_rate_ratio(wav, text: str, sample_rate: int, speaker_seconds_per_char: float) -> float:
    """One generated clip's seconds per character over the speaker's (1.0 = the speaker's pace;
    above 1 slower, below 1 faster)."""
    if speaker_seconds_per_char <= 0:
        raise ValueError(f"the speaker's seconds per character must be > 0, got {speaker_seconds_per_char}")
    return seconds_per_character([wav], [text], sample_rate) / speaker_seconds_per_char


def frame_limit(
    text: str,
    speaker_seconds_per_char: float,
    *,
    factor: float = DEFAULT_LIMIT_FACTOR,
    min_frames: int = DEFAULT_MIN_FRAMES,
    max_frames: int | None = None,
) -> int:
    """``max_new_tokens`` for ``text``: ``factor`` times the frames the speaker would need for it,
    at least ``min_frames`` (and at most ``max_frames`` when given)."""
    frames = math.ceil(factor * text_characters(text) * speaker_seconds_per_char * FRAME_RATE)
    limit = max(int(min_frames), frames)
    return limit if max_frames is None else max(1, min(limit, int(max_frames)))


def max_new_tokens_for(limit: int) -> int:
    """The ``max_new_tokens`` to generate with so that ``limit`` frames can be judged: the official
    generation returns one frame fewer than the talker tokens it drew (the last token is never
    expanded into codes), and cuts the codes at the first ``codec_eos``. With ``limit + 1`` tokens a
    generation that never stops returns exactly ``limit`` frames, and one that stops within the
    limit returns fewer."""
    return int(limit) + 1


def hit_frame_limit(num_frames: int, limit: int) -> bool:
    """True when a generation (run with `max_new_tokens_for(limit)`) did not end within ``limit``
    frames: an end-of-speech failure."""
    return int(num_frames) >= int(limit)
