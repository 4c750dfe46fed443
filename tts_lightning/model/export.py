"""Export a training checkpoint to a ``custom_voice`` directory that `qwen_tts` speaks with.

The released layout, with the new speakers named in ``talker_config.spk_id`` and their fp32
embeddings written into the matching ``codec_embedding`` rows (a custom-voice model looks a speaker
up there and gets exactly the likelihoods the speaker slot had in training). The speaker encoder is
dropped, as in a released CustomVoice model. Written beside its destination and renamed, so a crash
leaves no half export.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Literal

import torch

from tts_lightning.files import staged_directory
from tts_lightning.model.checkpoint import CheckpointError, load_training_checkpoint
from tts_lightning.model.pretrained import check_pretrained

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


class ExportError(ValueError):
    """The export cannot be written as asked (name clash, bad checkpoint, existing output)."""


def _new_speaker_ids(talker_config: dict, count: int) -> list[int]:
    """Unused codec ids for new speakers: 3000, 3001, ... on the released models (vocab 3072), the
    same place (vocab - 72) on smaller vocabularies; never an id a special token or speaker uses."""
    vocab = int(talker_config["vocab_size"])
    used = {v for k, v in talker_config.items() if k.startswith("codec_") and isinstance(v, int)}
    used |= set((talker_config.get("codec_language_id") or {}).values())
    used |= set((talker_config.get("spk_id") or {}).values())
    ids, candidate = [], vocab - 72
    while len(ids) < count:
        if candidate >= vocab:
            raise ExportError(f"no free codec id left for {count} new speakers (vocab {vocab})")
        if candidate not in used:
            ids.append(candidate)
        candidate += 1
    return ids


def export_custom_voice(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: Literal["bf16", "fp32", "fp16"] = "bf16",
    pretrained: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``out`` from a full or sharded `Qwen3TTSModule` checkpoint; return its path."""
    out = Path(out).expanduser().resolve()
    if dtype not in DTYPES:
        raise ExportError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if out.exists() and not overwrite:
        raise ExportError(f"{out} already exists (pass overwrite=True / --overwrite to replace it)")
    checkpoint = load_training_checkpoint(ckpt)
    hp = checkpoint.hyper_parameters
    speakers = [str(s).lower() for s in hp.get("speakers") or []]
    if not speakers:
        raise ExportError(f"{ckpt}: the checkpoint names no speakers (hyper_parameters.speakers is empty)")
    if len(set(speakers)) != len(speakers):
        raise ExportError(f"{ckpt}: speaker names clash after lower-casing: {hp.get('speakers')}")
    embeddings = checkpoint.state_dict.get("speaker_embeddings")
    if embeddings is None or embeddings.shape[0] != len(speakers):
        raise CheckpointError(f"{ckpt}: speaker_embeddings missing or not one row per speaker")
    if (embeddings.abs().sum(1) == 0).any():
        raise ExportError(f"{ckpt}: some speakers have no embedding yet (never seen in a step)")
    info = check_pretrained(pretrained or hp.get("pretrained"))
    config = json.loads((info.path / "config.json").read_text())
    talker = config["talker_config"]
    existing = {k.lower() for k in (talker.get("spk_id") or {})}
    clashes = sorted(set(speakers) & existing)
    if clashes:
        raise ExportError(f"speaker name(s) {clashes} already exist in {info.path}; rename them")

    state = {k: v for k, v in checkpoint.model_state_dict().items() if not k.startswith("speaker_encoder.")}
    table = state["talker.model.codec_embedding.weight"].float().clone()
    new_ids = _new_speaker_ids(talker, len(speakers))
    for name, row, embedding in zip(speakers, new_ids, embeddings):
        table[row] = embedding.float()
    state["talker.model.codec_embedding.weight"] = table
    target = DTYPES[dtype]
    state = {k: (v.to(target) if v.is_floating_point() else v).contiguous() for k, v in state.items()}

    config["tts_model_type"] = "custom_voice"
    talker["spk_id"] = {**(talker.get("spk_id") or {}), **dict(zip(speakers, new_ids))}
    talker["spk_is_dialect"] = {**(talker.get("spk_is_dialect") or {}), **{s: False for s in speakers}}
    config["torch_dtype"] = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}[dtype]

    from safetensors.torch import save_file

    with staged_directory(out) as tmp:
        for item in info.path.iterdir():
            if item.name in WEIGHT_FILES or item.name in ("config.json", "tiny_model.json") or item.name.startswith("model-"):
                continue
            if item.is_dir():
                shutil.copytree(item, tmp / item.name)
            else:
                shutil.copy2(item, tmp / item.name)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    return out
