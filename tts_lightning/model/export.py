"""Export a training checkpoint to a ``custom_voice`` directory that `qwen_tts` speaks with.

The released layout, with the new speakers named in ``talker_config.spk_id`` and their fp32
embeddings written into the matching ``codec_embedding`` rows (a custom-voice model looks a speaker
up there and gets exactly the likelihoods the speaker slot had in training). The speaker encoder is
dropped, as in a released CustomVoice model. Written beside its destination and renamed, so a crash
leaves no half export. The weights stream from the checkpoint a tensor at a time (never its
optimizer state), so export needs about one shard of memory, not the checkpoint's size.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Literal

import torch

from tts_lightning.files import staged_directory
from tts_lightning.model.checkpoint import CheckpointError, CheckpointReader
from tts_lightning.model.pretrained import check_pretrained

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
CODEC_EMBEDDING = "model.talker.model.codec_embedding.weight"
DEFAULT_SHARD_BYTES = 2**29  # safetensors shards of 512 MiB: export needs about two of them in memory


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


def _shards(reader: CheckpointReader, keys: list[str], itemsize: int, max_bytes: int) -> list[list[str]]:
    """Consecutive groups of keys of at most ``max_bytes`` in the target dtype (a tensor larger
    than that is a group of its own)."""
    groups: list[list[str]] = []
    size = 0
    for key in keys:
        nbytes = reader.numel(key) * itemsize
        if not groups or size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes
    return groups


def export_custom_voice(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: Literal["bf16", "fp32", "fp16"] = "bf16",
    pretrained: str | os.PathLike | None = None,
    overwrite: bool = False,
    trust_checkpoint: bool = False,
    max_shard_size: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write ``out`` from a full or sharded `Qwen3TTSModule` checkpoint; return its path.

    The weights are streamed: read from the checkpoint a few tensors at a time (never its
    optimizer state), cast, written as safetensors shards of at most ``max_shard_size`` bytes
    (one file when the model fits in one), and freed, so memory stays near one shard.
    """
    out = Path(out).expanduser().resolve()
    if dtype not in DTYPES:
        raise ExportError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if out.exists() and not overwrite:
        raise ExportError(f"{out} already exists (pass overwrite=True / --overwrite to replace it)")
    reader = CheckpointReader(ckpt, trust=trust_checkpoint)
    hp = reader.hyper_parameters
    speakers = [str(s).lower() for s in hp.get("speakers") or []]
    if not speakers:
        raise ExportError(f"{ckpt}: the checkpoint names no speakers (hyper_parameters.speakers is empty)")
    if len(set(speakers)) != len(speakers):
        raise ExportError(f"{ckpt}: speaker names clash after lower-casing: {hp.get('speakers')}")
    if "speaker_embeddings" not in reader.tensor_keys():
        raise CheckpointError(f"{ckpt}: speaker_embeddings missing")
    embeddings = reader.read(["speaker_embeddings"])["speaker_embeddings"]
    if embeddings.shape[0] != len(speakers):
        raise CheckpointError(f"{ckpt}: speaker_embeddings has {embeddings.shape[0]} rows for {len(speakers)} speakers")
    if (embeddings.abs().sum(1) == 0).any():
        raise ExportError(f"{ckpt}: some speakers have no embedding yet (never seen in a step)")
    info = check_pretrained(pretrained or hp.get("pretrained"))
    config = json.loads((info.path / "config.json").read_text())
    talker = config["talker_config"]
    existing = {k.lower() for k in (talker.get("spk_id") or {})}
    clashes = sorted(set(speakers) & existing)
    if clashes:
        raise ExportError(f"speaker name(s) {clashes} already exist in {info.path}; rename them")

    new_ids = _new_speaker_ids(talker, len(speakers))
    config["tts_model_type"] = "custom_voice"
    talker["spk_id"] = {**(talker.get("spk_id") or {}), **dict(zip(speakers, new_ids))}
    talker["spk_is_dialect"] = {**(talker.get("spk_is_dialect") or {}), **{s: False for s in speakers}}
    config["torch_dtype"] = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}[dtype]

    target = DTYPES[dtype]
    keys = [k for k in reader.tensor_keys() if k.startswith("model.") and not k.startswith("model.speaker_encoder.")]
    groups = _shards(reader, keys, torch.empty(0, dtype=target).element_size(), max_shard_size)
    names = (["model.safetensors"] if len(groups) == 1
             else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])

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
        weight_map: dict[str, str] = {}
        total = 0
        for name, group in zip(names, groups):
            shard: dict[str, torch.Tensor] = {}
            for key in group:  # one tensor at a time, read straight into the target dtype
                if key == CODEC_EMBEDDING:  # the new speakers' fp32 rows, then the cast
                    value = reader.read([key])[key].float().clone()
                    for row, embedding in zip(new_ids, embeddings):
                        value[row] = embedding.float()
                    value = value.to(target)
                else:
                    stored = reader.dtype(key)
                    value = reader.read([key], dtype=target if stored.is_floating_point else None)[key]
                value = value.contiguous()
                shard[key[len("model."):]] = value
                total += value.numel() * value.element_size()
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            del shard
        if len(names) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    return out
