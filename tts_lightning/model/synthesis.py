"""Speak with a pretrained or exported directory through the official `qwen_tts.Qwen3TTSModel`."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from tts_lightning.errors import UserError
from tts_lightning.model.pretrained import PretrainedInfo, check_pretrained
from tts_lightning.names import some_names, unknown_names


class SynthesisError(UserError, ValueError):
    """What `synthesize` was asked does not fit the model: a missing or unknown speaker, a missing
    reference clip, a language or a device it cannot use."""


def resolve_device(device: str | None = None) -> str:
    """The device to speak on: ``device`` as given (checked), else ``cuda`` when CUDA is available
    and ``cpu`` otherwise, as Hugging Face pipelines choose."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise SynthesisError(f"--device {device!r} is not a device; use cpu, cuda or cuda:N") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise SynthesisError(f"--device {device}: CUDA is not available on this machine; use --device cpu")
    return device


def read_text_file(path: str | os.PathLike, option: str = "--text-file") -> list[str]:
    """The non-empty lines of a UTF-8 text file, one text each (``option``: how the user named the
    file, for the message when it is missing or unreadable)."""
    path = Path(path).expanduser()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise UserError(f"{option} {path} does not exist") from None
    except IsADirectoryError:
        raise UserError(f"{option} {path} is a folder; give a text file with one text per line") from None
    except PermissionError:
        raise UserError(f"{option} {path} is not readable (permission denied)") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"{option} {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return [line.strip() for line in lines if line.strip()]


def supported_languages(info: PretrainedInfo) -> list[str]:
    """The ``language`` values the model accepts (what ``Qwen3TTSModel`` checks against)."""
    languages = info.config["talker_config"].get("codec_language_id") or {}
    return ["auto", *(name for name in languages if "dialect" not in name)]


def check_request(
    info: PretrainedInfo,
    *,
    speaker: str | None,
    ref_audio: str | os.PathLike | None,
    language: str,
    ref_text: str | None = None,
) -> None:
    """Raise `SynthesisError` when the model cannot speak as asked; before the model is loaded."""
    if ref_text is not None and info.tts_model_type != "base":
        raise SynthesisError(f"--ref-text clones in ICL mode, which needs a base model; {info.path} is not one")
    if info.tts_model_type == "custom_voice":
        if not speaker:
            raise SynthesisError(
                f"{info.path} is a custom_voice model: pass --speaker, one of {some_names(sorted(info.speakers))}"
            )
        if speaker.lower() not in info.speakers:
            known = sorted(info.speakers)
            raise SynthesisError(
                f"--speaker {unknown_names([speaker], known)} is not a speaker of {info.path}; "
                f"it has {some_names(known)}"
            )
    elif info.tts_model_type == "base":
        if ref_audio is None:
            raise SynthesisError(
                f"{info.path} is a base model: pass --ref-audio CLIP (a clip of the voice to clone), "
                "or give a custom_voice model (`tts-lightning export`) and --speaker"
            )
        if not Path(ref_audio).expanduser().is_file():
            raise SynthesisError(f"--ref-audio {ref_audio} does not exist")
    else:
        raise SynthesisError(
            f"{info.path}: synthesis of tts_model_type {info.tts_model_type!r} is not supported "
            "(give a custom_voice or a base model)"
        )
    languages = supported_languages(info)
    if language.lower() not in languages:
        raise SynthesisError(f"--language {language!r} is not one of this model's: {', '.join(languages)}")


# Texts spoken per `generate` call: qwen_tts pads a batch to its longest row and decodes it at once,
# and a row that never ends runs to max_new_tokens (at the 1.7B in bf16 about 0.1 MiB of KV cache per
# token and row, and ~1 GiB of decoding per row at 2048 frames), so 20 texts at once need ~19 GiB.
BATCH_SIZE = 4


def load_tts(path: str | os.PathLike, device: str, dtype: torch.dtype):
    """qwen_tts's `Qwen3TTSModel` on ``device`` in ``dtype`` (its speech tokenizer too: qwen_tts loads
    it with the same arguments)."""
    from qwen_tts import Qwen3TTSModel

    return Qwen3TTSModel.from_pretrained(str(path), device_map=device, dtype=dtype, attn_implementation="sdpa")


def default_dtype(device: str) -> Literal["bf16", "fp32"]:
    """bf16 on a GPU (half the memory of fp32: the 1.7B's weights 3.6 instead of 7.1 GiB), fp32 on the CPU.
    Not run on a GPU here: the choice and a bf16 model's synthesis on the CPU are tested
    (tests/model/test_cli_commands.py)."""
    return "bf16" if device.startswith("cuda") else "fp32"


def synthesize(
    model_dir: str | os.PathLike,
    texts: list[str],
    *,
    speaker: str | None = None,
    ref_audio: str | os.PathLike | None = None,
    ref_text: str | None = None,
    streaming: bool | None = None,
    language: str = "Auto",
    seed: int = 0,
    max_new_tokens: int | None = None,
    device: str | None = None,
    dtype: str | None = None,
    batch_size: int = BATCH_SIZE,
) -> tuple[list[np.ndarray], int]:
    """Generate one waveform per text.

    A ``custom_voice`` directory (what `export` writes) speaks as ``speaker``; a ``base`` directory
    clones the voice of ``ref_audio``: x-vector only, or in ICL mode when ``ref_text`` (its
    transcript) is given (what `export` writes for a run trained with ``data.layout: icl``).
    ``streaming`` picks the layout (default: qwen_tts's own for the call). The model and its speech
    tokenizer run on ``device`` (default: cuda when available, else cpu) in ``dtype`` (bf16, fp16 or
    fp32; default bf16 on a GPU, fp32 on the CPU), ``batch_size`` texts at a time (sampling draws
    for a whole batch: the same ``seed`` gives the same audio at the same ``batch_size``).
    """
    from tts_lightning.model.export import DTYPES

    if batch_size < 1:
        raise SynthesisError(f"--batch-size must be >= 1, got {batch_size}")
    if not texts:
        raise SynthesisError("no text to speak: give at least one")
    info = check_pretrained(model_dir)
    check_request(info, speaker=speaker, ref_audio=ref_audio, language=language, ref_text=ref_text)
    device = resolve_device(device)
    dtype = dtype or default_dtype(device)
    if dtype not in DTYPES:
        raise SynthesisError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    torch.manual_seed(seed)
    model = load_tts(info.path, device, DTYPES[dtype])
    kwargs: dict = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}
    if streaming is not None:
        kwargs["non_streaming_mode"] = not streaming
    if info.tts_model_type == "custom_voice":
        speak = partial(model.generate_custom_voice, speaker=speaker, language=language, **kwargs)
    else:
        prompt = model.create_voice_clone_prompt(  # made once, for every batch
            ref_audio=str(Path(ref_audio).expanduser()),  # type: ignore[arg-type]  # checked above
            ref_text=ref_text,
            x_vector_only_mode=ref_text is None,
        )
        speak = partial(model.generate_voice_clone, language=language, voice_clone_prompt=prompt, **kwargs)
    wavs: list[np.ndarray] = []
    sample_rate = 0
    for start in range(0, len(texts), batch_size):
        spoken, sample_rate = speak(text=texts[start : start + batch_size])
        wavs.extend(spoken)
    return wavs, sample_rate
