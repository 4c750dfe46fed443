"""Speak with a pretrained or exported directory through the official `qwen_tts.Qwen3TTSModel`."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch


def synthesize(
    model_dir: str | os.PathLike,
    texts: list[str],
    *,
    speaker: str | None = None,
    ref_audio: str | os.PathLike | None = None,
    language: str = "Auto",
    seed: int = 0,
    max_new_tokens: int | None = None,
) -> tuple[list[np.ndarray], int]:
    """Generate one waveform per text.

    A ``custom_voice`` directory (what `export` writes) speaks as ``speaker``; a ``base`` directory
    clones the voice of ``ref_audio`` (x-vector only, no reference transcript needed).
    """
    from qwen_tts import Qwen3TTSModel

    from tts_lightning.model.pretrained import check_pretrained

    info = check_pretrained(model_dir)
    torch.manual_seed(seed)
    model = Qwen3TTSModel.from_pretrained(str(info.path))
    kwargs = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}
    if info.tts_model_type == "custom_voice":
        if not speaker:
            raise ValueError(f"{info.path} is a custom_voice model: pass a speaker, one of {sorted(info.speakers)}")
        if speaker.lower() not in info.speakers:
            raise ValueError(f"speaker {speaker!r} is not in {info.path} (it has {sorted(info.speakers)})")
        return model.generate_custom_voice(text=texts, speaker=speaker, language=language, **kwargs)
    if info.tts_model_type == "base":
        if ref_audio is None:
            raise ValueError(f"{info.path} is a base model: pass --ref-audio to clone a voice")
        return model.generate_voice_clone(
            text=texts,
            language=language,
            ref_audio=str(Path(ref_audio)),
            x_vector_only_mode=True,
            **kwargs,
        )
    raise ValueError(f"{info.path}: synthesis of tts_model_type {info.tts_model_type!r} is not supported")
