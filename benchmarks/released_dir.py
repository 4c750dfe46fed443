"""A released-size Qwen3-TTS Base directory with random weights, built offline (for benchmarks only:
minutes and gigabytes, never in CI).

The model config is the planner's preset of the released architecture (`tts_lightning.distributed.
memory.PRESETS`: 0.6B = 914.6M, 1.7B = 1,928.7M parameters, codec special ids in the released
layout); the weights are random bf16 (0.02-std normals, norms 1), written as safetensors shards of
at most 1 GiB so that building needs about one shard of memory. The text tokenizer, the generation
config and the speech tokenizer come from a tiny directory built with the released codebook (2048
codes): they shape no parameter of the model, the tiny text tokenizer's ids lie inside the released
vocabulary, and every code the talker generates decodes.

    PYTHONPATH=. python benchmarks/released_dir.py 0.6b runs/bench/released-0.6b [talker layers]
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

SHARD_BYTES = 2**30


# ``small``: the released layout at a size a comparison can run beside other work (~93M parameters):
# the full 151,936-row text vocabulary (as 8 row blocks, 39M parameters) at a 256-wide text
# embedding, one talker and one code-predictor layer, hidden size 512.
SMALL = {"text_hidden_size": 256, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 1}


def build_released_dir(
    size: str, out: str | Path, seed: int = 0, talker_layers: int | None = None, small: bool = False
) -> Path:
    """Build (once) a random-weight directory of the released ``size`` ("0.6b" or "1.7b"); with
    ``talker_layers``, the same architecture with that many talker decoder layers (a mid-size model
    for memory comparisons that must not fill the machine); ``small``: `SMALL`'s sizes."""
    from safetensors.torch import save_file

    from tts_lightning.distributed.memory import PRESETS, build_meta_model
    from tts_lightning.model.tiny import build_tiny_pretrained

    out = Path(out)
    done = out / "released_dir.json"
    preset = json.loads(json.dumps(PRESETS[size]))
    # The speech tokenizer's codebook as released (2048 codes): the talker's codes then decode (the
    # samples callback's rounds); with the tiny default (256) every decode failed on an index.
    codebook = preset["talker_config"]["code_predictor_config"]["vocab_size"]
    key: dict = {"size": size, "seed": seed, "codebook_size": codebook}
    if talker_layers is not None:
        key["talker_layers"] = talker_layers
    if small:
        key["small"] = SMALL
    if done.is_file() and json.loads(done.read_text()) == key:
        return out
    if out.exists():
        shutil.rmtree(out)
    tiny = build_tiny_pretrained(codebook_size=codebook)
    shutil.copytree(tiny, out)
    for name in ("model.safetensors", "config.json", "tiny_model.json"):  # the tiny model's own
        (out / name).unlink()
    if talker_layers is not None:
        preset["talker_config"]["num_hidden_layers"] = talker_layers
    if small:
        talker = preset["talker_config"]
        talker.update(SMALL)
        talker["code_predictor_config"].update({k: v for k, v in SMALL.items() if k != "text_hidden_size"})
        preset["speaker_encoder_config"]["enc_dim"] = SMALL["hidden_size"]
    meta = build_meta_model(preset)
    config = meta.config.to_dict()  # every field, the special token ids included, as released
    config["speaker_encoder_config"].pop("model_type", None)  # as the tiny builder: it fails to load
    config.pop("transformers_version", None)
    generator = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, files = 0, []

    def flush() -> None:
        nonlocal shard, shard_bytes
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update({k: name for k in shard})
        shard, shard_bytes = {}, 0

    for name, param in meta.named_parameters():
        if param.dim() == 1 and "norm" in name:
            value = torch.ones(param.shape, dtype=torch.bfloat16)
        else:
            value = (torch.randn(param.shape, generator=generator) * 0.02).to(torch.bfloat16)
        if shard and shard_bytes + value.numel() * 2 > SHARD_BYTES:
            flush()
        shard[name] = value
        shard_bytes += value.numel() * 2
    flush()
    total = sum(p.numel() * 2 for p in meta.parameters())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    done.write_text(json.dumps(key))
    return out


if __name__ == "__main__":
    layers = int(sys.argv[3]) if len(sys.argv) > 3 else None
    print(build_released_dir(sys.argv[1], sys.argv[2], talker_layers=layers))
