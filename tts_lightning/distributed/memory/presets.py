"""Released-size presets (written from the published architecture) and `resolve_config`: a preset
name, a released hub id (mapped offline to its preset), a pretrained directory or a config dict
become the config the planner builds on the meta device."""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["PRESETS", "resolve_config"]


def _preset(size: str, hidden: int, intermediate: int) -> dict:
    """A released 12 Hz *Base* config, written from the published architecture. Fields that shape
    parameters or activations, and the codec special ids in the released layout (2048 codes, then
    the specials from 2048: inside the 3072-entry vocabulary, so a model built from a preset runs)."""
    from tts_lightning.model.tiny import codec_special_ids

    return {
        "architectures": ["Qwen3TTSForConditionalGeneration"],
        "model_type": "qwen3_tts",
        "tokenizer_type": "qwen3_tts_tokenizer_12hz",
        "tts_model_size": size,
        "tts_model_type": "base",
        "talker_config": {
            **codec_special_ids(2048),  # vocab_size 3072: 2048 codes + a block of 1024 specials
            "hidden_size": hidden,
            "intermediate_size": intermediate,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "hidden_act": "silu",
            "max_position_embeddings": 32768,
            "rope_theta": 1000000,
            "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20], "interleaved": True},
            "num_code_groups": 16,
            "text_hidden_size": 2048,
            "text_vocab_size": 151936,
            "spk_id": {},
            "spk_is_dialect": {},
            "code_predictor_config": {
                "vocab_size": 2048,
                "hidden_size": 1024,  # 0.6B: equal to the talker's, so small_to_mtp_projection is Identity
                "intermediate_size": 3072,
                "num_hidden_layers": 5,
                "num_attention_heads": 16,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "hidden_act": "silu",
                "max_position_embeddings": 65536,
                "num_code_groups": 16,
            },
        },
        "speaker_encoder_config": {
            "mel_dim": 128,
            "enc_dim": hidden,  # the x-vector goes straight into the talker's speaker slot
            "enc_channels": [512, 512, 512, 512, 1536],
            "enc_kernel_sizes": [5, 3, 3, 3, 1],
            "enc_dilations": [1, 2, 3, 4, 1],
            "enc_attention_channels": 128,
            "enc_res2net_scale": 8,
            "enc_se_channels": 128,
            "sample_rate": 24000,
        },
    }


# Meta-built totals: 1.7B 1,928,677,440 and 0.6B 914,643,008 parameters (shared doc: 1,928.7M and
# 914.6M), so no intermediate size needed adjusting.
PRESETS: dict[str, dict] = {
    "1.7b": _preset("1b7", hidden=2048, intermediate=6144),
    "0.6b": _preset("0b6", hidden=1024, intermediate=3072),
}
_HUB_ID = re.compile(r"^Qwen/Qwen3-TTS-12Hz-(1\.7B|0\.6B)-(\w+)$", re.IGNORECASE)


def resolve_config(model: str | os.PathLike | Mapping[str, Any]) -> tuple[str, dict]:
    """(display name, config dict) for a preset name, a released hub id (mapped to its preset,
    offline), a pretrained directory or its ``config.json``, or a config dict."""
    if isinstance(model, Mapping):
        return str(model.get("tts_model_size") or "custom config"), copy.deepcopy(dict(model))
    text = str(model)
    if text.lower() in PRESETS:
        return text.lower(), copy.deepcopy(PRESETS[text.lower()])
    path = Path(text).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return str(Path(text)), json.loads(path.read_text())
    hub = _HUB_ID.match(text)
    if hub:
        config = copy.deepcopy(PRESETS[hub.group(1).lower()])
        kind = hub.group(2).lower()
        config["tts_model_type"] = {"customvoice": "custom_voice", "voicedesign": "voice_design"}.get(kind, kind)
        return text, config
    raise ValueError(
        f"model {text!r}: not a preset ({', '.join(PRESETS)}), a released hub id "
        "(Qwen/Qwen3-TTS-12Hz-1.7B-Base, ...) or a directory with a config.json"
    )
