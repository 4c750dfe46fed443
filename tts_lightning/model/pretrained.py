"""Open a Qwen3-TTS 12 Hz pretrained directory (local path or hub id) and say clearly what is wrong.

Transformers reports a broken directory with a stack trace from deep inside its loaders; every check
here names the directory, the file and the problem instead. The tiny random model and the released
checkpoints go through exactly the same functions. Building the model with the directory's weights
is `tts_lightning.model.loading.build_model`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from tts_lightning.errors import UserError

TTS_MODEL_TYPES = ("base", "custom_voice", "voice_design")
TEXT_TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")


class PretrainedError(UserError, ValueError):
    """A pretrained directory is missing, incomplete or not a Qwen3-TTS 12 Hz checkpoint."""


@dataclass(frozen=True)
class PretrainedInfo:
    path: Path
    tts_model_type: str
    config: dict

    @property
    def speech_tokenizer_dir(self) -> Path:
        return self.path / "speech_tokenizer"

    @property
    def num_code_groups(self) -> int:
        return int(self.config["talker_config"]["num_code_groups"])

    @property
    def speakers(self) -> dict[str, int]:
        return dict(self.config["talker_config"].get("spk_id") or {})


def resolve_pretrained(name_or_path: str | os.PathLike) -> Path:
    """A local directory as it is; ``tiny``, the embedded tiny model (built into the user cache on
    first use, `tts_lightning.model.tiny.default_tiny_dir`); anything else is taken as a hub id and
    downloaded (cached)."""
    path = Path(name_or_path).expanduser()
    if (path / ".metadata").is_file() or (path.is_file() and path.suffix == ".ckpt"):
        raise PretrainedError(
            f"{path} is a training checkpoint, not a model directory: export it first "
            f"(tts-lightning export --ckpt {path} --out DIR) and give DIR"
        )
    if path.is_dir():
        return path.resolve()
    text = str(name_or_path)
    if text == "tiny":
        from tts_lightning.model.tiny import default_tiny_dir

        return default_tiny_dir()
    looks_like_hub_id = text.count("/") == 1 and not text.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise PretrainedError(
            f"pretrained directory {text!r} does not exist: give a Qwen3-TTS 12 Hz directory, a hub id "
            "(Qwen/Qwen3-TTS-12Hz-1.7B-Base) or tiny"
        )
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(text)).resolve()
    except Exception as exc:  # network, auth, unknown repo: all end the same way for the user
        raise PretrainedError(
            f"{text!r} is not a local directory and could not be downloaded from the hub "
            f"({type(exc).__name__}: {exc}). Pass a local directory, or build a tiny one with "
            "`tts-lightning tiny-model PATH`."
        ) from exc


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise PretrainedError(f"{path.parent}: {what} missing ({path.name} not found)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise PretrainedError(f"{path}: not valid JSON ({exc})") from exc


def check_pretrained(
    name_or_path: str | os.PathLike, *, require_type: str | tuple[str, ...] | None = None
) -> PretrainedInfo:
    """Resolve and validate a pretrained directory; raise `PretrainedError` naming what is wrong.
    ``require_type``: the ``tts_model_type`` (or types) accepted."""
    path = resolve_pretrained(name_or_path)
    config = _read_json(path / "config.json", "model config")
    if config.get("model_type") != "qwen3_tts":
        raise PretrainedError(
            f"{path / 'config.json'}: model_type is {config.get('model_type')!r}, expected 'qwen3_tts' "
            "(this is not a Qwen3-TTS checkpoint)"
        )
    tts_type = config.get("tts_model_type")
    if tts_type not in TTS_MODEL_TYPES:
        raise PretrainedError(
            f"{path / 'config.json'}: tts_model_type is {tts_type!r}, expected one of {TTS_MODEL_TYPES}"
        )
    if isinstance(require_type, tuple) and tts_type not in require_type:
        raise PretrainedError(
            f"{path / 'config.json'}: tts_model_type is {tts_type!r}, but one of {require_type} is required"
            + (" (fine-tuning starts from a *-Base or a *-CustomVoice model)" if "base" in require_type else "")
        )
    if isinstance(require_type, str) and tts_type != require_type:
        raise PretrainedError(
            f"{path / 'config.json'}: tts_model_type is {tts_type!r}, but {require_type!r} is required"
            + (" (fine-tuning starts from a *-Base model)" if require_type == "base" else "")
        )
    if config.get("tokenizer_type") != "qwen3_tts_tokenizer_12hz":
        raise PretrainedError(
            f"{path / 'config.json'}: tokenizer_type is {config.get('tokenizer_type')!r}; only the 12 Hz "
            "models (tokenizer_type 'qwen3_tts_tokenizer_12hz') are supported"
        )
    if not isinstance(config.get("talker_config"), dict):
        raise PretrainedError(f"{path / 'config.json'}: talker_config missing")
    if not ((path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()):
        raise PretrainedError(f"{path}: model weights missing (model.safetensors not found)")
    _read_json(path / "generation_config.json", "generation config")
    missing = [f for f in TEXT_TOKENIZER_FILES if not (path / f).is_file()]
    if missing:
        raise PretrainedError(f"{path}: text tokenizer incomplete, missing {', '.join(missing)}")
    speech = path / "speech_tokenizer"
    if not speech.is_dir():
        raise PretrainedError(f"{path}: speech tokenizer missing (no speech_tokenizer/ folder)")
    speech_cfg = _read_json(speech / "config.json", "speech tokenizer config")
    if speech_cfg.get("model_type") != "qwen3_tts_tokenizer_12hz":
        raise PretrainedError(
            f"{speech / 'config.json'}: model_type is {speech_cfg.get('model_type')!r}, "
            "expected 'qwen3_tts_tokenizer_12hz'"
        )
    _read_json(speech / "preprocessor_config.json", "speech tokenizer feature-extractor config")
    if not (speech / "model.safetensors").is_file():
        raise PretrainedError(f"{speech}: speech tokenizer weights missing (model.safetensors not found)")
    for weights in [*weight_files(path), speech / "model.safetensors"]:
        _check_weight_file(weights)
    return PretrainedInfo(path=path, tts_model_type=tts_type, config=config)


def weight_files(path: Path) -> list[Path]:
    """The model's safetensors files in a pretrained directory ``path``: the files its
    ``model.safetensors.index.json`` names, or ``model.safetensors`` alone."""
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return [path / "model.safetensors"]
    weight_map = _read_json(index, "weights index").get("weight_map") or {}
    return [path / name for name in sorted(set(weight_map.values()))]


def _check_weight_file(path: Path) -> None:
    """A weights file that is missing or cut short (an interrupted download or copy) is one line now,
    not an error of the loader after the data is prepared (its header and size are read; no tensor)."""
    from safetensors import safe_open

    if not path.is_file():
        raise PretrainedError(f"{path}: weights file missing (named by model.safetensors.index.json)")
    try:
        with safe_open(str(path), framework="pt"):
            pass
    except Exception as exc:  # safetensors' SafetensorError: a header that does not fit the file
        raise PretrainedError(f"{path} is damaged or incomplete ({exc}): download or copy it again") from exc


def load_config(info: PretrainedInfo, attn_implementation: str = "sdpa"):
    from qwen_tts.core.models import Qwen3TTSConfig

    config = Qwen3TTSConfig.from_pretrained(str(info.path))
    config._attn_implementation = attn_implementation
    config.talker_config._attn_implementation = attn_implementation
    config.talker_config.code_predictor_config._attn_implementation = attn_implementation
    return config


def load_state_dict(info: PretrainedInfo, prefix: str = "") -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (optionally only those under ``prefix``), in their stored dtype."""
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    for path in weight_files(info.path):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key.startswith(prefix):
                    state[key] = f.get_tensor(key)
    return state


def load_text_tokenizer(info: PretrainedInfo):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(info.path))


def load_speech_tokenizer(info: PretrainedInfo, device: str | torch.device = "cpu"):
    from qwen_tts import Qwen3TTSTokenizer

    tokenizer = Qwen3TTSTokenizer.from_pretrained(str(info.speech_tokenizer_dir))
    tokenizer.model.to(device)
    tokenizer.device = torch.device(device)
    return tokenizer
