"""Build a tiny, random-weight but complete Qwen3-TTS 12 Hz pretrained directory, offline.

The directory has the released layout (model config + weights, generation config, text tokenizer,
processor config, ``speech_tokenizer/``) and is built from the real ``qwen_tts`` classes, so every
code path that opens ``Qwen/Qwen3-TTS-12Hz-1.7B-Base`` opens it the same way. Only the sizes differ:
16 codebooks, 24 kHz and 1920 samples per frame are kept exactly; widths, depths and the codebook
size are small. The weights are drawn by `tiny_weights`, the text tokenizer is trained by
`tiny_tokenizer`; this module holds the configs and writes the directory.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from tts_lightning.errors import UserError
from tts_lightning.files import file_in_the_way, save_safetensors, staged_directory
from tts_lightning.model.tiny_tokenizer import TEXT_VOCAB_SIZE, build_text_tokenizer, special_id
from tts_lightning.model.tiny_weights import _fan_in_init, _init_speech_tokenizer

TINY_FORMAT_VERSION = 1  # bump when the layout or the init changes, so cached directories rebuild

NUM_CODE_GROUPS = 16
# The tiny custom_voice model's speakers (names of the released CustomVoice models); instruct works
# with them, as on the 1.7B CustomVoice (tts_model_size "tiny" is not the 0.6B's "0b6").
BUILT_IN_SPEAKERS = ("vivian", "ryan", "serena")
SAMPLE_RATE = 24_000
SAMPLES_PER_FRAME = 1920


def codec_special_ids(codebook_size: int) -> dict:
    """Special codec ids laid out as in the released models: codebook entries first, then a block
    of 1024 ids holding the specials (generation suppresses that block except ``codec_eos``)."""
    base = codebook_size
    return {
        "vocab_size": codebook_size + 1024,
        "codec_pad_id": base + 100,
        "codec_bos_id": base + 101,
        "codec_eos_token_id": base + 102,
        "codec_think_id": base + 106,
        "codec_nothink_id": base + 107,
        "codec_think_bos_id": base + 108,
        "codec_think_eos_id": base + 109,
        "codec_language_id": {
            "chinese": base + 7,
            "english": base + 2,
            "german": base + 5,
            "french": base + 13,
            "japanese": base + 10,
        },
    }


def tiny_configs(model_type: str = "base", codebook_size: int = 256) -> tuple[dict, dict]:
    """The model config and the speech-tokenizer config of the tiny directory, as plain dicts."""
    if model_type not in ("base", "custom_voice"):
        raise ValueError(f"model_type must be 'base' or 'custom_voice', got {model_type!r}")
    hidden = 64
    model = {
        "architectures": ["Qwen3TTSForConditionalGeneration"],
        "model_type": "qwen3_tts",
        "tokenizer_type": "qwen3_tts_tokenizer_12hz",
        "tts_model_size": "tiny",
        "tts_model_type": model_type,
        "im_start_token_id": special_id("<|im_start|>"),
        "im_end_token_id": special_id("<|im_end|>"),
        "tts_pad_token_id": special_id("<tts_pad>"),
        "tts_bos_token_id": special_id("<tts_text_bos>"),
        "tts_eos_token_id": special_id("<tts_text_eod>"),
        "talker_config": _talker_config(model_type, codebook_size, hidden),
        "speaker_encoder_config": {
            "mel_dim": 128,
            "enc_dim": hidden,  # the x-vector goes straight into the talker's speaker slot
            "enc_channels": [32, 32, 32, 32, 96],
            "enc_kernel_sizes": [5, 3, 3, 3, 1],
            "enc_dilations": [1, 2, 3, 4, 1],
            "enc_attention_channels": 16,
            "enc_res2net_scale": 4,
            "enc_se_channels": 16,
            "sample_rate": SAMPLE_RATE,
        },
    }
    return model, _speech_tokenizer_config(codebook_size)


def _talker_config(model_type: str, codebook_size: int, hidden: int) -> dict:
    """The talker (and its code predictor): the codec specials, small widths and depths."""
    text_hidden, cp_hidden = 48, 32
    codec = codec_special_ids(codebook_size)
    spk_id, spk_is_dialect = {}, {}
    if model_type == "custom_voice":
        # Built-in speakers as a released CustomVoice model has them (ids below the specials' block).
        spk_id = {name: codebook_size + 300 + i for i, name in enumerate(BUILT_IN_SPEAKERS)}
        spk_is_dialect = {name: False for name in BUILT_IN_SPEAKERS}
    return {
        **codec,
        "hidden_size": hidden,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 4096,
        "rope_theta": 10000,
        "rope_scaling": {"rope_type": "default", "mrope_section": [4, 2, 2], "interleaved": True},
        "num_code_groups": NUM_CODE_GROUPS,
        "text_hidden_size": text_hidden,
        "text_vocab_size": TEXT_VOCAB_SIZE,
        "spk_id": spk_id,
        "spk_is_dialect": spk_is_dialect,
        "code_predictor_config": {
            "vocab_size": codebook_size,
            "hidden_size": cp_hidden,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "max_position_embeddings": 64,
            "num_code_groups": NUM_CODE_GROUPS,
        },
    }


def _speech_tokenizer_config(codebook_size: int) -> dict:
    """The speech tokenizer: 16 codebooks at 24 kHz and 1920 samples per frame, as released."""
    # Encoder: Mimi at 24 kHz with a hop of 8*6*5*4 = 960 (25 Hz), halved to 12.5 Hz by the stride-2
    # downsample Mimi adds when frame_rate differs; decoder hop 2*2*8*5*4*3 = 1920.
    return {
        "architectures": ["Qwen3TTSTokenizerV2Model"],
        "model_type": "qwen3_tts_tokenizer_12hz",
        "encoder_valid_num_quantizers": NUM_CODE_GROUPS,
        "input_sample_rate": SAMPLE_RATE,
        "output_sample_rate": SAMPLE_RATE,
        "decode_upsample_rate": SAMPLES_PER_FRAME,
        "encode_downsample_rate": SAMPLES_PER_FRAME,
        "encoder_config": {
            "sampling_rate": SAMPLE_RATE,
            "frame_rate": SAMPLE_RATE / SAMPLES_PER_FRAME,
            "hidden_size": 32,
            "num_filters": 4,
            "upsampling_ratios": [8, 6, 5, 4],
            "codebook_size": codebook_size,
            "codebook_dim": 16,
            "num_quantizers": NUM_CODE_GROUPS,
            "num_semantic_quantizers": 1,
            "vector_quantization_hidden_dimension": 16,
            "upsample_groups": 32,
            "num_hidden_layers": 1,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "sliding_window": 250,
            "use_cache": False,
        },
        "decoder_config": {
            "codebook_size": codebook_size,
            "codebook_dim": 16,
            "hidden_size": 32,
            "latent_dim": 32,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_quantizers": NUM_CODE_GROUPS,
            "upsample_rates": [8, 5, 4, 3],
            "upsampling_ratios": [2, 2],
            "decoder_dim": 32,
            "sliding_window": 72,
        },
    }


def _generation_config() -> dict:
    # save_pretrained supplies no sampling defaults and qwen_tts falls back to max_new_tokens=2048,
    # far too long for a random model: write the released fields with a small length.
    return {
        "do_sample": True,
        "top_k": 50,
        "top_p": 1.0,
        "temperature": 0.9,
        "repetition_penalty": 1.05,
        "subtalker_dosample": True,
        "subtalker_top_k": 50,
        "subtalker_top_p": 1.0,
        "subtalker_temperature": 0.9,
        "max_new_tokens": 48,
    }


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _build(out: Path, seed: int, model_type: str, codebook_size: int) -> None:
    model_cfg, speech_cfg = tiny_configs(model_type, codebook_size)
    generator = torch.Generator().manual_seed(seed)  # the model's weights, then the speech tokenizer's
    _write_model(out, model_cfg, seed, generator)
    build_text_tokenizer(out)
    _write_speech_tokenizer(out / "speech_tokenizer", speech_cfg, seed, generator)


def _write_model(out: Path, model_cfg: dict, seed: int, generator: torch.Generator) -> None:
    """The model's weights, ``config.json`` and ``generation_config.json``."""
    from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration

    config = Qwen3TTSConfig(**{k: v for k, v in model_cfg.items() if k != "model_type"})
    config.architectures = model_cfg["architectures"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3TTSForConditionalGeneration(config)
    _fan_in_init(model, generator)  # custom_voice: the built-in speakers' rows are random too
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_safetensors(state, out / "model.safetensors", metadata={"format": "pt"})
    cfg_dict = config.to_dict()
    # save_pretrained writes speaker_encoder_config.model_type = "", which then fails to load.
    cfg_dict["speaker_encoder_config"].pop("model_type", None)
    cfg_dict.pop("transformers_version", None)  # keep bytes independent of the installed version
    cfg_dict["tts_lightning_tiny"] = {"seed": seed, "format_version": TINY_FORMAT_VERSION}
    _write_json(out / "config.json", cfg_dict)
    _write_json(out / "generation_config.json", _generation_config())


def _write_speech_tokenizer(speech_dir: Path, speech_cfg: dict, seed: int, generator: torch.Generator) -> None:
    """``speech_tokenizer/``: its weights, ``config.json`` and ``preprocessor_config.json``."""
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import (
        Qwen3TTSTokenizerV2Config,
    )
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model

    speech_dir.mkdir()
    speech_config = Qwen3TTSTokenizerV2Config(**{k: v for k, v in speech_cfg.items() if k not in ("model_type",)})
    speech_config.architectures = speech_cfg["architectures"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        speech_model = Qwen3TTSTokenizerV2Model(speech_config)
    _fan_in_init(speech_model, generator)
    _init_speech_tokenizer(speech_model, generator)
    speech_state = {k: v.detach().contiguous() for k, v in speech_model.state_dict().items()}
    save_safetensors(speech_state, speech_dir / "model.safetensors", metadata={"format": "pt"})
    speech_dict = speech_config.to_dict()
    speech_dict.pop("transformers_version", None)
    _write_json(speech_dir / "config.json", speech_dict)
    _write_json(
        speech_dir / "preprocessor_config.json",
        {
            "chunk_length_s": None,
            "feature_extractor_type": "EncodecFeatureExtractor",
            "feature_size": 1,
            "overlap": None,
            "padding_side": "right",
            "padding_value": 0.0,
            "return_attention_mask": True,
            "sampling_rate": SAMPLE_RATE,
        },
    )


class TinyModelExistsError(UserError, FileExistsError):
    """The path given for a tiny model holds something else (another tiny model, other files)."""


def tiny_cache_dir() -> Path:
    """Where tiny models built on first use live: ``$TTS_LIGHTNING_CACHE``, else ``~/.cache/tts-lightning``."""
    root = os.environ.get("TTS_LIGHTNING_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tts-lightning"
    )
    return Path(root)


def build_tiny_pretrained(
    path: str | os.PathLike | None = None,
    *,
    seed: int = 0,
    model_type: str = "base",
    codebook_size: int = 256,
) -> Path:
    """Write a tiny random-weight Qwen3-TTS 12 Hz pretrained directory and return its path.

    ``path`` None puts it in the user cache, named after the arguments. The same arguments give
    the same bytes; a directory already built with the same arguments is reused as it is. The
    directory is written beside its final place and renamed, so an interrupted build leaves
    nothing half-written.
    """
    if codebook_size & (codebook_size - 1) or not 16 <= codebook_size <= 2048:
        raise ValueError(f"codebook_size must be a power of 2 in [16, 2048], got {codebook_size}")
    key = {
        "seed": seed,
        "model_type": model_type,
        "codebook_size": codebook_size,
        "format_version": TINY_FORMAT_VERSION,
    }
    if model_type == "custom_voice":  # a third built-in speaker: cached 2-speaker directories rebuild
        key["speakers"] = len(BUILT_IN_SPEAKERS)
    if path is None:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
        path = tiny_cache_dir() / f"tiny-qwen3-tts-{model_type}-{digest}"
    out = Path(path).expanduser().resolve()
    file = file_in_the_way(out)
    if file is not None:
        raise TinyModelExistsError(f"{file} is a file; choose a folder path for the tiny model")
    stamp = out / "tiny_model.json"
    if stamp.is_file():
        if json.loads(stamp.read_text()) == key:
            return out
        raise TinyModelExistsError(
            f"{out} holds a tiny model built with other arguments ({stamp.read_text().strip()}); "
            "choose another path or delete it"
        )
    if out.exists() and any(out.iterdir()):
        raise TinyModelExistsError(
            f"{out} exists and is not a tiny model directory; refusing to overwrite it: choose another path"
        )

    with staged_directory(out) as tmp:
        _build(tmp, seed, model_type, codebook_size)
        _write_json(tmp / "tiny_model.json", key)
        try:
            if out.exists():
                out.rmdir()  # empty, checked above (unless another process has just filled it)
            os.replace(tmp, out)
        except OSError:
            # Another process built it first: theirs is identical for the same arguments.
            if not (out / "tiny_model.json").is_file():
                raise
    return out


def default_tiny_dir() -> Path:
    """The tiny base model (seed 0) that ``pretrained: tiny`` names, built on first use into the user
    cache (``$TTS_LIGHTNING_CACHE``, else ``~/.cache/tts-lightning``) and reused afterwards.

    Several processes (the ranks of a run) may ask at once: each builds in its own temporary folder
    and renames it into place. A process that loses the race finds the winner's identical directory
    on its second look; any other failure is raised again by that second look.
    """
    try:
        return build_tiny_pretrained()
    except OSError:
        return build_tiny_pretrained()
