"""The model on the meta device and its sharding units: the real `Qwen3TTSForConditionalGeneration`
is built with no memory and no weights (LoRA adapters injected with peft when asked), and its
parameters are grouped into units the way each strategy groups them.

The text embedding is split into row blocks first, as `Qwen3TTSModule` does
(`tts_lightning.model.row_blocks`): each block is an ``nn.Embedding`` unit of its own.

* ``fsdp1`` (`Qwen3TTSFSDPStrategy`): FSDP's auto-wrap with the strategy's ``auto_wrap_policy``
  (default ``DEFAULT_WRAP``: both decoder-layer classes and every ``nn.Embedding``); each parameter
  belongs to its innermost wrapped module, the rest to the root; with an adapter, each leaf module
  whose parameters all train (the adapter matrices, ``adapter.trainable``) is a unit of its own.
* ``fsdp2`` (`Qwen3TTSFSDP2Strategy`, ``fully_shard``): one unit per module of the layer classes
  (default both decoder-layer classes and the text embedding's row blocks), one per group of
  module-name globs (default: the codec embeddings together, the speaker encoder), the root holding
  the rest.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Literal

import torch
from torch import nn

from tts_lightning.distributed.memory.presets import resolve_config
from tts_lightning.model.parameters import matches
from tts_lightning.model.row_blocks import DEFAULT_TEXT_EMBEDDING_BLOCKS, split_text_embedding

__all__ = [
    "FSDP2_GROUPS",
    "FSDP2_LAYERS",
    "LAYOUTS",
    "PREDICTOR_LAYER",
    "TALKER_LAYER",
    "TEXT_EMBEDDING",
    "UNUSED_IN_TRAINING",
    "ModelShape",
    "Unit",
    "build_meta_model",
    "count_parameters",
    "model_shape",
]

TEXT_EMBEDDING = "talker.model.text_embedding"
TALKER_LAYER = "qwen_tts.core.models.modeling_qwen3_tts.Qwen3TTSTalkerDecoderLayer"
PREDICTOR_LAYER = "qwen_tts.core.models.modeling_qwen3_tts.Qwen3TTSDecoderLayer"
LAYOUTS = ("fsdp1", "fsdp2")
# `Qwen3TTSFSDP2Strategy`'s defaults (its ``layer_classes`` and ``groups``), written here so that
# importing the planner loads nothing of the strategy's module (its `group_members` is imported when
# the FSDP2 units are built); tests/distributed/test_memory_fsdp2.py checks them.
FSDP2_LAYERS = (TALKER_LAYER, PREDICTOR_LAYER, "tts_lightning.model.row_blocks.EmbeddingRowBlock")
TALKER_CODEC, PREDICTOR_CODEC = "talker.model.codec_embedding", "talker.code_predictor.model.codec_embedding"
FSDP2_GROUPS = (
    (TALKER_CODEC, f"{PREDICTOR_CODEC}.*"),
    ("speaker_encoder",),
)
# Modules the training step never runs (the x-vectors are precomputed by the data module): under
# FSDP2 a unit made only of them is never gathered.
UNUSED_IN_TRAINING = ("speaker_encoder",)

UnitKind = Literal["root", "embedding", "layer", "adapter", "other"]


@dataclass(frozen=True)
class Unit:
    """One sharding unit: its module path ('' for the root; an FSDP2 group of several modules is
    named by its globs), kind and (parameter name, numel) pairs; ``rows`` holds each parameter's
    size along dim 0 (FSDP2 shards every parameter on it), in the order of ``params``."""

    name: str
    kind: UnitKind
    params: tuple[tuple[str, int], ...]
    rows: tuple[int, ...] = ()
    # Gathered, with its full gradient, from the first gradient reaching it to the end of the
    # backward. FSDP2 runs a unit's post-backward when a gradient reaches its forward's inputs, else
    # at the end: a group of embeddings (ids in; the text embedding's row blocks have an anchor).
    # FSDP1 runs it when the unit's gradient is complete: the codec embeddings the code predictor
    # reads early in the backward and the talker at its end (`_fsdp1_units`).
    held_in_backward: bool = False

    @property
    def numel(self) -> int:
        return sum(n for _, n in self.params)

    @property
    def gathered_in_training(self) -> bool:
        """False for a unit whose parameters all belong to modules the training step never runs."""
        return not self.params or not all(matches(p, list(UNUSED_IN_TRAINING)) for p, _ in self.params)


@dataclass(frozen=True)
class ModelShape:
    units: tuple[Unit, ...]
    dims: Mapping[str, int]

    @property
    def numel(self) -> int:
        return sum(u.numel for u in self.units)

    def param_numels(self) -> dict[str, int]:
        return {name: n for u in self.units for name, n in u.params}


def _import_classes(paths: Sequence[str]) -> tuple[type[nn.Module], ...]:
    from tts_lightning.distributed.fsdp import import_classes

    return tuple(sorted(import_classes(list(paths)), key=lambda c: c.__qualname__))


def build_meta_model(config: Mapping[str, Any]) -> nn.Module:
    """The real `Qwen3TTSForConditionalGeneration` on the meta device (no memory, no weights)."""
    with contextlib.redirect_stdout(io.StringIO()):  # qwen_tts prints a flash-attn banner on import
        from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration

    cfg = Qwen3TTSConfig.from_dict(copy.deepcopy(dict(config)))
    with torch.device("meta"):
        return Qwen3TTSForConditionalGeneration(cfg)


def _kind(module: nn.Module, name: str) -> UnitKind:
    if isinstance(module, nn.Embedding):
        return "embedding"
    if "DecoderLayer" in type(module).__name__:
        return "layer"
    return "adapter" if ".lora_" in f".{name}" else "other"


def _rows(param: nn.Parameter) -> int:
    return int(param.shape[0]) if param.dim() > 0 else 1


def _fsdp1_units(model: nn.Module, wrap: Sequence[str], adapter: Any) -> list[Unit]:
    """FSDP1's auto-wrap: each parameter in its innermost wrapped module, the rest in the root."""
    from tts_lightning.model.lora import checkpoint_key, is_adapter_key

    wrap_classes = _import_classes(wrap)
    units: list[Unit] = []
    seen: set[int] = set()

    def own_unit(child: nn.Module, name: str) -> bool:
        if isinstance(child, wrap_classes):
            return True
        if adapter is None or list(child.children()):
            return False
        params = [f"{name}.{n}" for n, _ in child.named_parameters(recurse=False)]
        return bool(params) and all(is_adapter_key(p) or matches(checkpoint_key(p), adapter.trainable) for p in params)

    def collect(module: nn.Module, prefix: str, owned: list[tuple[str, nn.Parameter]]) -> None:
        for name, param in module.named_parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                owned.append((f"{prefix}{name}", param))
        for name, child in module.named_children():
            if own_unit(child, f"{prefix}{name}"):
                mine: list[tuple[str, nn.Parameter]] = []
                collect(child, f"{prefix}{name}.", mine)
                units.append(_unit(f"{prefix}{name}", _kind(child, f"{prefix}{name}"), mine))
            else:
                collect(child, f"{prefix}{name}.", owned)

    root: list[tuple[str, nn.Parameter]] = []
    collect(model, "", root)
    units.insert(0, _unit("", "root", root))
    # A unit's post-backward runs when its gradient is complete: the codec embeddings the code
    # predictor reads (its input, early in the backward) and the talker too (its input, at the end)
    # stay gathered, with their gradient, in between; the predictor's last one is read by the talker
    # alone (tests/distributed/test_fsdp2.py records both strategies).
    indices = [u.name.removeprefix(f"{PREDICTOR_CODEC}.") for u in units if u.name.startswith(f"{PREDICTOR_CODEC}.")]
    predictor = [f"{PREDICTOR_CODEC}.{i}" for i in sorted(int(i) for i in indices if i.isdigit())]
    early = {TALKER_CODEC, *predictor[:-1]}
    return [replace(u, held_in_backward=True) if u.name in early else u for u in units]


def _fsdp2_units(model: nn.Module, layers: Sequence[str], groups: Sequence[Sequence[str]]) -> list[Unit]:
    """``fully_shard`` as `Qwen3TTSFSDP2Strategy` applies it: each module of the layer classes, each
    group (the outermost modules its globs match, together), then the root; a parameter belongs
    to the innermost of them that contains it."""
    from tts_lightning.distributed.fsdp2 import group_members

    layer_classes = _import_classes(layers)
    modules = dict(model.named_modules())
    owner: dict[str, tuple[str, UnitKind]] = {}  # module name -> (unit name, kind)
    order: list[tuple[str, UnitKind]] = []
    held: set[str] = set()
    for name, module in modules.items():
        if name and isinstance(module, layer_classes):
            owner[name] = (name, _kind(module, name))  # the text embedding's row blocks: "embedding"
            order.append(owner[name])
    for globs in groups:
        members = group_members(model, globs)
        if members is None:
            continue
        unit_name = members[0] if len(members) == 1 else " + ".join(globs)
        kinds = {_kind(modules[m], m) for m in members}
        entry = (unit_name, kinds.pop() if len(kinds) == 1 else "other")
        if entry[1] == "embedding":
            held.add(unit_name)
        for m in members:
            owner[m] = entry
        order.append(entry)
    params: dict[str, list[tuple[str, nn.Parameter]]] = {name: [] for name, _ in order}
    root: list[tuple[str, nn.Parameter]] = []
    for pname, param in model.named_parameters():  # shared parameters once, as FSDP sees them
        parts = pname.split(".")[:-1]
        target = root
        for depth in range(len(parts), 0, -1):
            hit = owner.get(".".join(parts[:depth]))
            if hit is not None:
                target = params[hit[0]]
                break
        target.append((pname, param))
    units = [_unit(name, kind, params[name], held_in_backward=name in held) for name, kind in order]
    return [_unit("", "root", root), *units]


def _unit(name: str, kind: UnitKind, params: list[tuple[str, nn.Parameter]], **flags: bool) -> Unit:
    return Unit(name, kind, tuple((n, p.numel()) for n, p in params), tuple(_rows(p) for _, p in params), **flags)


@lru_cache(maxsize=16)
def _model_shape(
    config_json: str,
    wrap: tuple[str, ...],
    adapter_json: str = "null",
    layout: str = "fsdp1",
    groups_json: str = "null",
    text_embedding_blocks: int = DEFAULT_TEXT_EMBEDDING_BLOCKS,
) -> ModelShape:
    from tts_lightning.model.lora import LoRASettings, inject_lora

    model: Any = build_meta_model(json.loads(config_json))
    split_text_embedding(model, text_embedding_blocks)  # as `Qwen3TTSModule.configure_model` does
    adapter = LoRASettings.coerce(json.loads(adapter_json))
    if adapter is not None:
        model = inject_lora(model, adapter)
    if layout == "fsdp2":
        groups = json.loads(groups_json)
        units = _fsdp2_units(model, wrap, FSDP2_GROUPS if groups is None else groups)
    else:
        units = _fsdp1_units(model, wrap, adapter)

    talker = model.talker
    layer = talker.model.layers[0]
    predictor = talker.code_predictor
    cp_layer = predictor.model.layers[0]
    if adapter is not None:  # the widths of the base layers, not of peft's wrappers
        from peft.tuners.lora import LoraLayer

        for mod in list(model.modules()):
            for child_name, child in list(mod.named_children()):
                if isinstance(child, LoraLayer):
                    setattr(mod, child_name, child.get_base_layer())
    dims = {
        "layers": len(talker.model.layers),
        "hidden": layer.self_attn.q_proj.in_features,
        "attn": layer.self_attn.q_proj.out_features,
        "kv": layer.self_attn.k_proj.out_features,
        "intermediate": layer.mlp.gate_proj.out_features,
        "vocab": talker.codec_head.out_features,
        "text_hidden": talker.text_projection.linear_fc1.in_features,
        "text_intermediate": talker.text_projection.linear_fc1.out_features,
        "cp_layers": len(predictor.model.layers),
        "cp_hidden": cp_layer.self_attn.q_proj.in_features,
        "cp_attn": cp_layer.self_attn.q_proj.out_features,
        "cp_kv": cp_layer.self_attn.k_proj.out_features,
        "cp_intermediate": cp_layer.mlp.gate_proj.out_features,
        "cp_vocab": predictor.lm_head[0].out_features,
        "cp_heads": len(predictor.lm_head),
        "code_groups": len(predictor.lm_head) + 1,
        "cp_projection": int(isinstance(predictor.small_to_mtp_projection, nn.Linear)),
    }
    return ModelShape(tuple(units), dims)


def model_shape(
    model: str | os.PathLike | Mapping[str, Any],
    wrap: Sequence[str] | None = None,
    adapter: Any = None,
    *,
    layout: Literal["fsdp1", "fsdp2"] = "fsdp1",
    groups: Sequence[Sequence[str]] | None = None,
    text_embedding_blocks: int = DEFAULT_TEXT_EMBEDDING_BLOCKS,
) -> ModelShape:
    """Sharding units and activation-relevant widths of a model, from its meta-device build (with
    the LoRA adapters of ``adapter`` injected, as `Qwen3TTSModule` does). ``wrap``: FSDP1's
    ``auto_wrap_policy`` (default ``DEFAULT_WRAP``) or, with ``layout="fsdp2"``, the layer classes
    (default `FSDP2_LAYERS`); ``groups``: FSDP2's module-name glob groups (default `FSDP2_GROUPS`);
    ``text_embedding_blocks``: `Qwen3TTSModule`'s row blocks of the text embedding."""
    from tts_lightning.distributed.fsdp import DEFAULT_WRAP
    from tts_lightning.model.lora import LoRASettings

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    _, config = resolve_config(model)
    settings = LoRASettings.coerce(adapter)
    default_wrap = DEFAULT_WRAP if layout == "fsdp1" else FSDP2_LAYERS
    return _model_shape(
        json.dumps(config, sort_keys=True),
        tuple(default_wrap if wrap is None else wrap),
        json.dumps(None if settings is None else settings.to_dict(), sort_keys=True),
        layout,
        json.dumps(None if groups is None else [list(g) for g in groups]),
        text_embedding_blocks,
    )


def count_parameters(model: str | os.PathLike | Mapping[str, Any]) -> int:
    return model_shape(model).numel
