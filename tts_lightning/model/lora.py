"""LoRA adapters for Qwen3-TTS, built with `peft`, on a model whose parameters are still on the meta
device (`tts_lightning.model.loading.build_empty_model`).

peft replaces each targeted ``nn.Linear`` by its LoRA layer: the frozen base weight moves to
``<name>.base_layer.weight`` and the adapter adds ``<name>.lora_A.default.weight`` (r x in) and
``<name>.lora_B.default.weight`` (out x r). `tts_lightning.model.loading.MetaWeights` reads the base
weights at their old names (`checkpoint_key`) and initialises the adapters with `init_adapter`:
lora_A as peft does (Kaiming-uniform, a=sqrt(5)) from a generator seeded by the setting's seed and
the parameter's name (the same values on every rank and every run), lora_B zeros, so the adapted
model computes exactly the base model's function at step 0.

The merged weight of a targeted layer is ``W + scaling * B @ A`` with ``scaling = alpha / rank``.
"""

from __future__ import annotations

import fnmatch
import math
import zlib
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from tts_lightning.errors import ConfigError
from tts_lightning.model.row_blocks import block_groups, join_blocks, official_layout

ADAPTER_NAME = "default"
BASE_LAYER = ".base_layer."

# Attention and MLP projections of every talker and code-predictor decoder layer.
DEFAULT_TARGETS = [
    "talker.model.layers.*.self_attn.*_proj",
    "talker.model.layers.*.mlp.*_proj",
    "talker.code_predictor.model.layers.*.self_attn.*_proj",
    "talker.code_predictor.model.layers.*.mlp.*_proj",
]


@dataclass
class LoRASettings:
    """A LoRA adapter (trained with `peft`); every field can be set from YAML under
    ``model.adapter``.

    Published settings that worked on the real models: rank 16 / alpha 32 at lr 2e-6 on the 1.7B,
    rank 64 / alpha 128 at lr 2e-6 to 5e-6 for 30-120 clips; lr 2e-5 gives noise.

    Args:
        rank: the adapter's rank r.
        alpha: scaling numerator; the update is ``alpha / rank * B @ A``.
        dropout: dropout on the adapter's input (training only).
        target_modules: glob patterns over full module names (``fnmatch``) of the ``nn.Linear``
            layers that get an adapter. Default: the attention and MLP projections of the talker's
            and the code predictor's decoder layers.
        trainable: module-name patterns (a module, a prefix or a glob) kept fully trainable besides
            the adapters, e.g. ``talker.codec_head`` or ``talker.code_predictor.lm_head``.
        seed: seeds the adapters' initial values (lora_A), independently of the run's seed.
        base_dtype: the frozen weights' storage: ``auto`` = bf16 when the trainer's precision is
            bf16 (``bf16-mixed``: half the memory of the frozen base, which is never updated), else
            fp32; or ``fp32`` / ``bf16``. The adapters and the extras stay fp32 (master weights).
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    trainable: list[str] = field(default_factory=list)
    seed: int = 0
    base_dtype: Literal["auto", "fp32", "bf16"] = "auto"

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ConfigError(f"model.adapter.rank must be >= 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.adapter.dropout must lie in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ConfigError("model.adapter.target_modules is empty: name the nn.Linear layers to adapt")
        self.target_modules = list(self.target_modules)
        self.trainable = list(self.trainable)

    def frozen_dtype(self, precision: str | None) -> torch.dtype:
        """The dtype the frozen weights are stored in under the trainer's ``precision``."""
        bf16 = str(precision or "").startswith("bf16")
        if self.base_dtype == "bf16" and precision is not None and not bf16:
            raise ConfigError(
                f"model.adapter.base_dtype bf16 needs a bf16 trainer precision (bf16-mixed), not {precision!r}"
            )
        if self.base_dtype == "bf16" or (self.base_dtype == "auto" and bf16):
            return torch.bfloat16
        return torch.float32

    @property
    def scaling(self) -> float:
        return float(self.alpha) / int(self.rank)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def coerce(cls, value: Any) -> LoRASettings | None:  # settings, a dict, jsonargparse's Namespace, None
        if value is None or isinstance(value, LoRASettings):
            return value
        if isinstance(value, dict):
            return cls(**value)
        # jsonargparse may hand over a Namespace
        return cls(**vars(value))


def target_names(model: nn.Module, settings: LoRASettings) -> list[str]:
    """The full names of the ``nn.Linear`` modules the patterns select (an error if none)."""
    names = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and any(fnmatch.fnmatchcase(name, p) for p in settings.target_modules)
    ]
    if not names:
        raise ConfigError(f"model.adapter.target_modules {settings.target_modules} match no nn.Linear of the model")
    return names


def lora_config(settings: LoRASettings, targets: list[str], *, base_model: str | None = None):
    from peft import LoraConfig

    return LoraConfig(
        r=int(settings.rank),
        lora_alpha=settings.alpha,  # type: ignore[arg-type]  # annotated int; peft scales by alpha / r
        lora_dropout=float(settings.dropout),
        target_modules=list(targets),
        bias="none",
        init_lora_weights=True,
        base_model_name_or_path=base_model,
    )


def inject_lora(model: nn.Module, settings: LoRASettings) -> nn.Module:
    """Add the adapters to a (meta-device) model in place with peft; every adapter parameter is
    left on the meta device for `init_adapter` (through `MetaWeights`)."""
    from peft import inject_adapter_in_model

    targets = target_names(model, settings)
    model = inject_adapter_in_model(lora_config(settings, targets), model, adapter_name=ADAPTER_NAME)
    # The adapter computes in the dtype of its input (the base layer's compute dtype: bf16 under
    # FSDP mixed precision, whose adapter units get bf16 copies), not cast to the fp32 master dtype.
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if isinstance(module, LoraLayer):
            module.cast_input_dtype_enabled = False
    # peft allocates the adapters on the base weight's device (meta here); make sure of it
    for full, param in list(model.named_parameters()):
        if is_adapter_key(full) and not param.is_meta:
            owner = model.get_submodule(full.rpartition(".")[0])
            leaf = full.rpartition(".")[2]
            owner._parameters[leaf] = nn.Parameter(torch.empty(param.shape, device="meta"), requires_grad=True)
    return model


def is_adapter_key(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name or name.startswith(("lora_A.", "lora_B."))


def checkpoint_key(name: str) -> str:
    """The pretrained checkpoint's name of a (possibly peft-renamed) parameter."""
    return name.replace(BASE_LAYER, ".")


def _seed_of(name: str, seed: int) -> int:
    return (zlib.crc32(name.encode()) + 1_000_003 * int(seed)) % (2**63)


def init_adapter(name: str, value: torch.Tensor, seed: int = 0) -> None:
    """Fill an adapter parameter in place as peft initialises it, deterministically: lora_A
    Kaiming-uniform (a=sqrt(5)) from a generator seeded by ``seed`` and ``name``; lora_B zeros."""
    if ".lora_B." in name or name.startswith("lora_B."):
        value.zero_()
        return
    generator = torch.Generator(device="cpu").manual_seed(_seed_of(name, seed))
    drawn = torch.empty(value.shape, dtype=torch.float32)  # drawn in fp32 on the CPU whatever ``value`` is
    nn.init.kaiming_uniform_(drawn, a=math.sqrt(5), generator=generator)  # as nn.Linear and peft
    value.copy_(drawn.to(device=value.device, dtype=value.dtype))


class MergedWeights(Mapping):
    """The plain model's parameters by their original names, LoRA adapters merged into their base
    weights (in fp32, cast back) when read: one merged weight exists at a time. Works on a model
    with peft LoRA layers and on a plain one; wrapper prefixes (FSDP, activation checkpointing) are
    removed from the names.

    ``state``: the values to read instead of the model's own parameters, by the model's parameter
    names (a full state gathered from shards, e.g. `get_model_state_dict(full_state_dict=True)`).
    Its keys decide which parameters exist: under FSDP1 a module may hold a parameter as a plain
    tensor view (NO_SHARD after a forward), which ``named_parameters`` does not list."""

    def __init__(self, model: nn.Module, state: Mapping[str, torch.Tensor] | None = None) -> None:
        from torch.distributed.fsdp._common_utils import clean_tensor_name

        if state is None:
            state = {name: p for name, p in model.named_parameters()}
        self._state = state
        self._original = {clean_tensor_name(name): name for name in state}
        self._params = {clean_tensor_name(name): value for name, value in state.items()}
        self._scaling: dict[str, float] = {}
        for name, module in model.named_modules():
            s = getattr(module, "scaling", None)
            if isinstance(s, dict) and ADAPTER_NAME in s and hasattr(module, "base_layer"):
                self._scaling[clean_tensor_name(name)] = float(s[ADAPTER_NAME])
        self._names = {checkpoint_key(n): n for n in self._params if not is_adapter_key(n)}
        # The text embedding's row blocks (`tts_lightning.model.row_blocks`) read as the one official
        # weight, joined when read.
        self._blocks = block_groups(self._names)
        self._keys = official_layout(self._names)

    def _sources(self, key: str) -> list[str]:
        """The names ``key`` (not a blocked embedding) is read from: its own, and a LoRA layer's adapters."""
        name = self._names[key]
        if not name.endswith(".base_layer.weight"):
            return [name]
        layer = name[: -len(".base_layer.weight")]
        return [name, f"{layer}.lora_A.{ADAPTER_NAME}.weight", f"{layer}.lora_B.{ADAPTER_NAME}.weight"]

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self._blocks:
            return join_blocks({k: self[k] for k in self._blocks[key]}, self._blocks[key])
        sources = self._sources(key)
        value = self._params[sources[0]].detach()
        if len(sources) == 3:
            a, b = (self._params[n].detach() for n in sources[1:])
            value = merge(value, a, b, self._scaling[sources[0][: -len(".base_layer.weight")]]).to(value.dtype)
        return value

    def copy_into(self, key: str, out: torch.Tensor, *, release: bool = False) -> None:
        """Write ``key``'s value into ``out`` (any dtype, any device). A blocked embedding is copied
        block by block into its rows, never joined: its whole value exists once, in ``out``.
        ``release``: drop each source (`release`) as soon as it is copied."""
        if key not in self._blocks:
            value = self[key]
            if value.shape != out.shape:  # copy_ would broadcast a smaller value silently
                raise ValueError(f"{key!r} is {tuple(value.shape)}, the copy's {tuple(out.shape)}")
            out.copy_(value)
            del value
            if release:
                self.release(key)
            return
        row = 0
        for block in self._blocks[key]:
            value = self[block]
            if value.shape[1:] != out.shape[1:]:
                raise ValueError(f"{block!r} is {tuple(value.shape)}, the rows of {key!r} {tuple(out.shape[1:])}")
            out[row : row + value.shape[0]].copy_(value)
            row += value.shape[0]
            del value  # nothing here keeps a released block
            if release:
                self.release(block)
        if row != out.shape[0]:
            raise ValueError(f"the blocks of {key!r} hold {row} rows, the copy {out.shape[0]}")

    def release(self, key: str) -> None:
        """Drop the values ``key`` is read from, here and in ``state`` (which the caller hands over):
        a copy built from a gathered full state then frees it as it goes."""
        for block in self._blocks.get(key, [key]):
            for name in self._sources(block):
                del self._params[name]
                if isinstance(self._state, MutableMapping):
                    self._state.pop(self._original[name], None)

    def __contains__(self, key: object) -> bool:  # without reading (joining, merging) the value
        if key in self._blocks:
            return all(self._names[block] in self._params for block in self._blocks[key])
        return key in self._names and self._names[key] in self._params

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def merge(base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``base + scaling * B @ A`` in fp32."""
    return base.float() + scaling * (lora_b.float() @ lora_a.float())
