"""Per-GPU memory planner for fine-tuning Qwen3-TTS with `Qwen3TTSFSDPStrategy`.

Sizes are never read from a table: the real `Qwen3TTSForConditionalGeneration` is built on the meta
device from a config (a preset written below from the published architecture, a pretrained
directory's ``config.json``, or a config dict), and the FSDP units are found by applying the
strategy's own wrap policy to that module tree.

What is modelled, per GPU (bytes; GiB = 2**30 in the table and for ``gpu_memory_gb``):

* **Model states** (persistent; AdamW, fp32 master weights under both precisions):
  parameters 4 B, gradients 4 B, optimizer states 8 B (``exp_avg`` + ``exp_avg_sq``), each divided
  by the number of GPUs for FULL_SHARD / SHARD_GRAD_OP, replicated for NO_SHARD (FSDP1 also falls
  back to NO_SHARD on one GPU). Frozen parameters keep their 4 B but have no optimizer state.
  Gradients are modelled per FSDP unit, as FSDP (``use_orig_params=True``) holds them: a unit
  whose parameters are all frozen has no gradient; a unit that mixes frozen and trainable
  parameters keeps a gradient for the *whole* flat parameter, frozen part included. With the
  default wrap the frozen speaker encoder sits in the root unit next to trainable heads, so its
  12M parameters do cost gradient memory; a frozen ``text_embedding`` is its own unit and costs
  none. FSDP's padding of flat parameters to a multiple of the world size is ignored (< N elements
  per unit).
* **Gathered parameters** (transient, compute dtype: 2 B under bf16-mixed, 4 B under 32-true):
  the root unit (everything outside the wrapped classes) is gathered for the whole step and its
  unsharded gradient lives through the whole backward; other units are gathered one at a time,
  with at most one more prefetched (``limit_all_gathers``), and each one's unsharded gradient exists
  in the compute dtype plus an fp32 copy for the reduce-scatter (``reduce_dtype`` fp32).
  SHARD_GRAD_OP keeps every unit gathered from its forward until its backward, so all parameters
  in the compute dtype at the peak.
* **Activations**: see `_activation_bytes`; the constants were counted on the real layer classes.
* **Peak** = model states + overhead + the larger of two phases: (a) the start of backward, with all
  activations alive, the root unit and two decoder-layer units gathered; (b) the end of backward,
  when activations are freed but the largest unit (the 311M-parameter ``text_embedding`` of the
  released models) is gathered with its unsharded gradient.
* **cpu_offload**: sharded parameters, gradients and optimizer states live in host memory (the
  optimizer steps there); the GPU keeps gathered units, unsharded gradients in flight, activations.
* **Overhead**: a constant 1 GiB for the CUDA context, cuBLAS/cuDNN/NCCL workspaces and caching-
  allocator fragmentation. It is not measured; real fragmentation can be larger.

* **LoRA** (``adapter``): the adapters are injected with peft into the meta model, so their
  parameters are counted exactly; each adapter matrix (and each leaf module trained in full,
  ``adapter.trainable``) is an FSDP unit of its own, as `Qwen3TTSFSDPStrategy` wraps them, so only
  they have gradients (4 B) and AdamW states (8 B). The frozen base is stored in the run's
  precision (``adapter.base_dtype: auto``): 2 B per parameter under bf16-mixed, 4 B under 32-true,
  sharded like any parameter. The adapters' own activations (r values per token per adapted
  layer) are not modelled.

Not modelled: DDP's own gradient buckets (NO_SHARD here means FSDP NO_SHARD), the attention mask
(B x S x S bytes, shared by all layers), the speech tokenizer (not used in training), eval steps.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from tts_lightning.model.parameters import DEFAULT_FREEZE, matches

GiB = 2**30
CUDA_OVERHEAD_BYTES = 1 * GiB  # CUDA context + library workspaces + allocator fragmentation: a constant
TEXT_EMBEDDING = "talker.model.text_embedding"
SHARDINGS = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
PRECISIONS = ("bf16-mixed", "32-true")
TALKER_LAYER = "qwen_tts.core.models.modeling_qwen3_tts.Qwen3TTSTalkerDecoderLayer"
PREDICTOR_LAYER = "qwen_tts.core.models.modeling_qwen3_tts.Qwen3TTSDecoderLayer"

# Bytes saved for backward per token per decoder layer, as coefficients of
# (H = hidden, A = heads * head_dim, KV = kv_heads * head_dim, I = intermediate), by compute dtype.
# Counted with torch.autograd.graph.saved_tensors_hooks (unique storages) on the real classes driven
# by `tts_lightning.model.loss.compute_loss`, varying one width at a time; the fits are exact to
# < 4% at widths of 256 and the residual shrinks with width. H: two RMSNorms (each saves an fp32
# copy of its input plus bf16 casts) and the projections' inputs; A: q, attention output and o_proj
# input; I: gate, up, act(gate) and the down_proj input. The talker gets an attention mask (padded
# batches), so transformers expands K/V to all heads (repeat_kv) before SDPA: K/V cost ~A there.
# The code predictor runs without a mask and uses SDPA's native GQA. GPU flash / memory-efficient
# SDPA saves the same q, k, v, output and logsumexp, with no sequence x sequence term.
TALKER_LAYER_BYTES = {2: (16, 14, 6, 8), 4: (24, 24, 8, 16)}
PREDICTOR_LAYER_BYTES = {2: (16, 10, 10, 8), 4: (24, 16, 16, 16)}
# Logits: each one is kept as fp32 in the loss output (the module's accuracy metrics read it),
# saved again as fp32 log-softmax by cross-entropy, and gets an fp32 gradient: 12 bytes.
LOGIT_BYTES = 12


# -- presets -----------------------------------------------------------------------------------
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


# -- the model on the meta device ------------------------------------------------------------
@dataclass(frozen=True)
class Unit:
    """One FSDP unit: its module path ('' for the root), kind and (parameter name, numel) pairs."""

    name: str
    kind: Literal["root", "embedding", "layer", "other"]
    params: tuple[tuple[str, int], ...]

    @property
    def numel(self) -> int:
        return sum(n for _, n in self.params)


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


@lru_cache(maxsize=16)
def _model_shape(config_json: str, wrap: tuple[str, ...], adapter_json: str = "null") -> ModelShape:
    from tts_lightning.model.lora import LoRASettings, checkpoint_key, inject_lora, is_adapter_key

    model = build_meta_model(json.loads(config_json))
    adapter = LoRASettings.coerce(json.loads(adapter_json))
    if adapter is not None:
        model = inject_lora(model, adapter)
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

    def collect(module: nn.Module, prefix: str, owned: list) -> None:
        # Assign each parameter to the innermost enclosing wrapped module, as FSDP's auto-wrap does.
        for name, param in module.named_parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                owned.append((f"{prefix}{name}", param.numel()))
        for name, child in module.named_children():
            if own_unit(child, f"{prefix}{name}"):
                mine: list = []
                collect(child, f"{prefix}{name}.", mine)
                kind = (
                    "embedding"
                    if isinstance(child, nn.Embedding)
                    else (
                        "layer"
                        if "DecoderLayer" in type(child).__name__
                        else ("adapter" if ".lora_" in f".{prefix}{name}" else "other")
                    )
                )
                units.append(Unit(f"{prefix}{name}", kind, tuple(mine)))
            else:
                collect(child, f"{prefix}{name}.", owned)

    root: list = []
    collect(model, "", root)
    units.insert(0, Unit("", "root", tuple(root)))

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
    model: str | os.PathLike | Mapping[str, Any], wrap: Sequence[str] | None = None, adapter: Any = None
) -> ModelShape:
    """FSDP units and activation-relevant widths of a model, from its meta-device build (with the
    LoRA adapters of ``adapter`` injected, as `Qwen3TTSModule` does)."""
    from tts_lightning.distributed.fsdp import DEFAULT_WRAP
    from tts_lightning.model.lora import LoRASettings

    _, config = resolve_config(model)
    settings = LoRASettings.coerce(adapter)
    return _model_shape(
        json.dumps(config, sort_keys=True),
        tuple(DEFAULT_WRAP if wrap is None else wrap),
        json.dumps(None if settings is None else settings.to_dict(), sort_keys=True),
    )


def count_parameters(model: str | os.PathLike | Mapping[str, Any]) -> int:
    return model_shape(model).numel


# -- activations --------------------------------------------------------------------------------
def _layer_bytes(coef: tuple[int, ...], h: int, a: int, kv: int, i: int) -> int:
    return coef[0] * h + coef[1] * a + coef[2] * kv + coef[3] * i


def _activation_bytes(
    d: Mapping[str, int],
    positions: int,
    b: int,
    ckpt_talker: bool,
    ckpt_predictor: bool,
    frames: int | None = None,
    targets: int | None = None,
) -> tuple[int, int]:
    """(activations alive at the start of backward, logits/outputs alive until the step ends).

    ``positions`` = padded talker positions per micro-batch (the data module's
    ``max_frames_per_batch``); code-predictor frames and talker targets are bounded by it (the text
    prefill has no frames), so both are taken equal to it unless given: an upper bound.
    Talker, per position: each of the L layers saves ``TALKER_LAYER_BYTES`` (all of them without
    checkpointing; only its b*H input with checkpointing, plus one layer's full set while that
    layer is recomputed in backward); outside the layers, the text projection (b*(T + 2*I_t)), the
    final RMSNorm ((4 + 2b)*H) and the codec_head input (b*H).
    Code predictor, per frame: 16 positions through its layers (same rule, ``PREDICTOR_LAYER_BYTES``),
    the small_to_mtp_projection input (b*16*H, when it is a Linear), its final norm ((4+2b)*16*H_cp).
    Logits: talker ``vocab`` per target and 15 x ``cp_vocab`` per frame, ``LOGIT_BYTES`` each.
    """
    P = positions
    F = positions if frames is None else frames
    targets = F if targets is None else targets
    talker_layer = _layer_bytes(TALKER_LAYER_BYTES[b], d["hidden"], d["attn"], d["kv"], d["intermediate"])
    cp_layer = _layer_bytes(PREDICTOR_LAYER_BYTES[b], d["cp_hidden"], d["cp_attn"], d["cp_kv"], d["cp_intermediate"])
    cp_tokens = F * d["code_groups"]
    recompute = 0
    if ckpt_talker:
        talker = P * d["layers"] * b * d["hidden"]
        recompute = max(recompute, P * talker_layer)
    else:
        talker = P * d["layers"] * talker_layer
    if ckpt_predictor:
        predictor = cp_tokens * d["cp_layers"] * b * d["cp_hidden"]
        recompute = max(recompute, cp_tokens * cp_layer)
    else:
        predictor = cp_tokens * d["cp_layers"] * cp_layer
    other = (
        P * b * (d["text_hidden"] + 2 * d["text_intermediate"])
        + P * (4 + 2 * b) * d["hidden"]
        + targets * b * d["hidden"]
        + cp_tokens * b * d["hidden"] * d["cp_projection"]
        + cp_tokens * (4 + 2 * b) * d["cp_hidden"]
    )
    logits = LOGIT_BYTES * (targets * d["vocab"] + F * d["cp_heads"] * d["cp_vocab"])
    return talker + predictor + recompute + other, logits


# -- the plan -----------------------------------------------------------------------------------
@dataclass
class MemoryPlan:
    """Bytes per GPU (host memory per GPU process for ``host_memory``)."""

    model: str
    gpus: int
    gpu_memory: int
    sharding: str
    precision: str
    activation_checkpointing: bool
    cpu_offload: bool
    freeze: list[str]
    micro_batch_frames: int
    total_parameters: int
    trainable_parameters: int
    parameters: int  # persistent fp32 (master) parameters on the GPU
    gradients: int  # persistent fp32 sharded gradients on the GPU
    optimizer_states: int  # AdamW exp_avg + exp_avg_sq, fp32
    largest_gathered_unit: int  # biggest non-root FSDP unit, full, in the compute dtype
    root_unit: int  # the root unit, full, in the compute dtype (gathered for the whole step)
    gathered: int  # transient unsharded parameters and gradients at the peak
    activations: int  # at the peak (zero-ish in the end-of-backward phase)
    overhead: int
    total: int
    fits: bool
    headroom: int
    host_memory: int  # per GPU process, with cpu_offload
    peak_phase: str
    units: int
    largest_unit_name: str = ""
    samples: bool = False  # SpeakerSamplesCallback on: rank 0's sampling phase is planned too
    samples_model: int = 0  # rank 0: the generation copy of the model, compute dtype
    samples_cache: int = 0  # rank 0: the talker's KV cache for all sampled rows
    speech_tokenizer: int = 0  # rank 0: the speech tokenizer on the GPU while it decodes (fp32)
    samples_total: int = 0  # rank 0 at the sampling peak (training activations are gone then)
    adapter: dict | None = None  # LoRA settings (`tts_lightning.model.lora.LoRASettings`), if any
    notes: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states

    def table(self) -> str:
        g = lambda x: f"{x / GiB:8.2f}"  # noqa: E731
        ckpt = "on" if self.activation_checkpointing else "off"
        offload = "on" if self.cpu_offload else "off"
        cdt = "bf16" if self.precision == "bf16-mixed" else "fp32"
        frozen = ", ".join(self.freeze) or "nothing"
        if self.adapter is not None:
            frozen = f"everything but LoRA r{self.adapter['rank']}/alpha{self.adapter['alpha']:g} adapters" + (
                f" and {', '.join(self.adapter['trainable'])}" if self.adapter.get("trainable") else ""
            )
        lines = [
            f"Qwen3-TTS memory plan: {self.model}: {self.total_parameters / 1e6:,.1f}M parameters, "
            f"{self.trainable_parameters / 1e6:,.1f}M trainable (frozen: {frozen})",
            f"{self.gpus} GPU(s) x {self.gpu_memory / GiB:.1f} GiB, {self.sharding}, {self.precision}, "
            f"activation checkpointing {ckpt}, cpu offload {offload}, "
            f"{self.micro_batch_frames} talker positions per micro-batch, {self.units} FSDP units",
            "                                                    GiB per GPU",
            f"  parameters (fp32 master)                         {g(self.parameters)}",
            f"  gradients (fp32)                                 {g(self.gradients)}",
            f"  optimizer states (AdamW, fp32)                   {g(self.optimizer_states)}",
            f"  gathered units + unsharded grads (at the peak)   {g(self.gathered)}",
            f"    for reference: root unit, full {cdt} (all step) {g(self.root_unit)}",
            f"    for reference: largest unit, full {cdt}         {g(self.largest_gathered_unit)}"
            f"  ({self.largest_unit_name})",
            f"  activations + logits (at the peak)               {g(self.activations)}",
            f"  CUDA context + allocator (constant)              {g(self.overhead)}",
            f"  total at the peak                                {g(self.total)}",
            f"    (peak: {self.peak_phase})",
            f"  GPU memory                                       {g(self.gpu_memory)}",
            f"  headroom                                         {g(self.headroom)}",
        ]
        if self.samples:
            lines += [
                "  samples (SpeakerSamplesCallback, rank 0, after validation):",
                f"    model states + generation copy {g(self.samples_model)} + KV cache {g(self.samples_cache)}"
                f" + CUDA, then the speech tokenizer {g(self.speech_tokenizer)} instead of the copy",
                f"    total at the sampling peak                     {g(self.samples_total)}",
            ]
        if self.cpu_offload:
            lines.append(
                f"  host memory for offloaded states: {self.host_memory / GiB:.2f} GiB per GPU, "
                f"{self.host_memory * self.gpus / GiB:.2f} GiB for {self.gpus} GPU(s) on one node (pinned)"
            )
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _checkpointed(activation_checkpointing: bool | Sequence[str]) -> tuple[bool, bool]:
    if isinstance(activation_checkpointing, bool):
        return activation_checkpointing, activation_checkpointing
    classes = set(_import_classes(list(activation_checkpointing)))
    talker_cls, cp_cls = _import_classes([TALKER_LAYER])[0], _import_classes([PREDICTOR_LAYER])[0]
    return (any(issubclass(talker_cls, c) for c in classes), any(issubclass(cp_cls, c) for c in classes))


def plan_memory(
    model: str | os.PathLike | Mapping[str, Any],
    *,
    gpus: int,
    gpu_memory_gb: float,
    sharding: Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"] = "FULL_SHARD",
    precision: Literal["bf16-mixed", "32-true"] = "bf16-mixed",
    activation_checkpointing: bool | Sequence[str] = True,
    cpu_offload: bool = False,
    freeze: Sequence[str] = DEFAULT_FREEZE,
    micro_batch_frames: int = 2000,
    auto_wrap_policy: Sequence[str] | None = None,
    samples: bool = False,
    sample_rows: int = 4,
    sample_frames: int = 600,
    advise: bool = True,
    adapter: Any = None,
) -> MemoryPlan:
    """Plan per-GPU memory for one training step.

    Args:
        model: ``"1.7b"``, ``"0.6b"``, a released hub id, a pretrained directory, or a config dict.
        gpus: data-parallel GPUs (FSDP world size). gpu_memory_gb: memory of one GPU, in GiB.
        activation_checkpointing: True (both decoder-layer classes, the strategy's default), False,
            or a list of class import paths as in ``activation_checkpointing_policy``.
        freeze: parameter-name patterns, as `Qwen3TTSModule`'s ``freeze``.
        micro_batch_frames: padded talker positions per micro-batch (``max_frames_per_batch``).
        auto_wrap_policy: class import paths; default the strategy's ``DEFAULT_WRAP``.
        samples: plan `SpeakerSamplesCallback` too: on rank 0, after validation, a copy of the model
            in the compute dtype plus the KV cache of ``sample_rows`` rows (speakers x texts) of up
            to ``sample_frames`` frames (``max_new_tokens``), then the speech tokenizer (counted when
            ``model`` is a local directory) while it decodes.
        adapter: LoRA settings (`tts_lightning.model.lora.LoRASettings` or its dict) as
            `Qwen3TTSModule`'s ``adapter``: only the adapters and ``adapter.trainable`` train.
    """
    from tts_lightning.model.lora import LoRASettings, checkpoint_key, is_adapter_key

    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if gpus < 1 or micro_batch_frames < 1 or gpu_memory_gb <= 0:
        raise ValueError("gpus, micro_batch_frames and gpu_memory_gb must be positive")
    name, config = resolve_config(model)
    settings = LoRASettings.coerce(adapter)
    shape = model_shape(config, auto_wrap_policy, settings)
    freeze = list(freeze)
    b = 2 if precision == "bf16-mixed" else 4
    notes: list[str] = []
    effective = sharding
    if gpus == 1 and sharding != "NO_SHARD":
        effective = "NO_SHARD"
        notes.append(f"{sharding} on one GPU runs as NO_SHARD (FSDP switches when the world size is 1)")
    shards = gpus if effective != "NO_SHARD" else 1

    def is_trainable(p: str) -> bool:
        if settings is None:
            return not matches(p, freeze)
        return (is_adapter_key(p) or matches(checkpoint_key(p), settings.trainable)) and not matches(
            checkpoint_key(p), freeze
        )

    def trainable(unit: Unit) -> int:
        return sum(n for p, n in unit.params if is_trainable(p))

    total_params = shape.numel
    train_params = sum(trainable(u) for u in shape.units)
    grad_numel = sum(u.numel for u in shape.units if trainable(u))
    mixed = [u.name or "root" for u in shape.units if 0 < trainable(u) < u.numel]
    if mixed:
        frozen_in_mixed = sum(u.numel - trainable(u) for u in shape.units if 0 < trainable(u) < u.numel)
        notes.append(
            f"{frozen_in_mixed / 1e6:.1f}M frozen parameters share a unit with trainable ones "
            f"({', '.join(mixed[:3])}{'...' if len(mixed) > 3 else ''}): FSDP keeps their gradient"
        )
    params_b = 4 * math.ceil(total_params / shards)
    if settings is not None:  # the frozen base in its storage dtype (bf16 under bf16-mixed), the rest fp32
        frozen_bytes = 2 if settings.frozen_dtype(precision) == torch.bfloat16 else 4
        params_b = 4 * math.ceil(train_params / shards) + frozen_bytes * math.ceil(
            (total_params - train_params) / shards
        )
        notes.append(
            f"LoRA: frozen base stored in {'bf16' if frozen_bytes == 2 else 'fp32'}, "
            f"adapters{' and extras' if settings.trainable else ''} in fp32 with AdamW state"
        )
    grads_b = 4 * math.ceil(grad_numel / shards)
    optim_b = 8 * math.ceil(train_params / shards)
    host = 0
    if cpu_offload:
        host = params_b + grads_b + optim_b
        params_b = grads_b = optim_b = 0

    root = shape.units[0]
    others = shape.units[1:]
    largest = max(others, key=lambda u: u.numel, default=None)
    layer_units = [u for u in others if u.kind != "embedding"] or list(others)
    largest_layer = max(layer_units, key=lambda u: u.numel, default=None)

    def unit_transient(unit: Unit | None, copies: int) -> int:
        # `copies` gathered copies in the compute dtype + its unsharded gradient (compute dtype
        # and an fp32 copy for the reduce-scatter) when it has trainable parameters.
        if unit is None:
            return 0
        return unit.numel * (copies * b + ((b + 4) if trainable(unit) else 0))

    root_b = root.numel * b
    root_grad = root.numel * b if trainable(root) else 0
    if effective == "NO_SHARD" and precision == "32-true" and not cpu_offload:
        # Parameters are used in place and gradients accumulate into the persistent fp32 ones.
        phase_a_units = phase_b_units = 0
        gathered_root = 0
    elif effective == "SHARD_GRAD_OP":
        gathered_root = root_b + root_grad
        all_gathered = sum(u.numel for u in others) * b
        phase_a_units = all_gathered + unit_transient(largest_layer, 0)
        phase_b_units = all_gathered + unit_transient(largest, 0)
    else:  # FULL_SHARD, or NO_SHARD with bf16 copies of each unit's parameters
        gathered_root = root_b + root_grad
        phase_a_units = unit_transient(largest_layer, 2)  # the running unit + one prefetched
        phase_b_units = unit_transient(largest, 1)

    ckpt_t, ckpt_cp = _checkpointed(activation_checkpointing)
    acts, logits = _activation_bytes(shape.dims, micro_batch_frames, b, ckpt_t, ckpt_cp)
    phase_a = gathered_root + phase_a_units + acts + logits
    phase_b = gathered_root + phase_b_units + logits
    if phase_a >= phase_b:
        phase, gathered, activations = (
            "start of backward, activations alive",
            gathered_root + phase_a_units,
            acts + logits,
        )
    else:
        phase, gathered, activations = "end of backward, largest unit", gathered_root + phase_b_units, logits
    persistent = params_b + grads_b + optim_b
    total = persistent + CUDA_OVERHEAD_BYTES + max(phase_a, phase_b)
    samples_model = samples_cache = tokenizer = samples_total = 0
    if samples:
        d = shape.dims
        samples_model = total_params * b
        prefill = 64  # role, tags, speaker and a sentence of text
        samples_cache = sample_rows * (prefill + sample_frames) * d["layers"] * 2 * d["kv"] * b
        tokenizer = speech_tokenizer_bytes(model)
        if not tokenizer:
            notes.append("the speech tokenizer is not counted (plan a local pretrained directory to count it)")
        samples_total = persistent + CUDA_OVERHEAD_BYTES + max(samples_model + samples_cache, tokenizer)
        notes.append(
            f"samples: rank 0 gathers the fp32 weights to host memory first "
            f"({4 * total_params / GiB:.1f} GiB of RAM, released before generation)"
        )
        total = max(total, samples_total)
    gpu_memory = int(gpu_memory_gb * GiB)
    plan = MemoryPlan(
        model=name,
        gpus=gpus,
        gpu_memory=gpu_memory,
        sharding=sharding,
        precision=precision,
        activation_checkpointing=bool(ckpt_t or ckpt_cp),
        cpu_offload=cpu_offload,
        freeze=freeze,
        micro_batch_frames=micro_batch_frames,
        total_parameters=total_params,
        trainable_parameters=train_params,
        parameters=params_b,
        gradients=grads_b,
        optimizer_states=optim_b,
        largest_gathered_unit=(largest.numel * b) if largest else 0,
        root_unit=root_b,
        gathered=gathered,
        activations=activations,
        overhead=CUDA_OVERHEAD_BYTES,
        total=total,
        fits=total <= gpu_memory,
        headroom=gpu_memory - total,
        host_memory=host,
        peak_phase=phase,
        units=len(shape.units),
        largest_unit_name=largest.name if largest else "",
        notes=notes,
        samples=samples,
        samples_model=samples_model,
        samples_cache=samples_cache,
        speech_tokenizer=tokenizer,
        samples_total=samples_total,
        adapter=None if settings is None else settings.to_dict(),
    )
    if ckpt_t != ckpt_cp:
        notes.append("activation checkpointing covers only the " + ("talker" if ckpt_t else "code predictor"))
    if advise and not plan.fits:
        plan.advice = _advice(
            config,
            plan,
            dict(
                gpus=gpus,
                gpu_memory_gb=gpu_memory_gb,
                sharding=sharding,
                precision=precision,
                activation_checkpointing=activation_checkpointing,
                cpu_offload=cpu_offload,
                freeze=freeze,
                micro_batch_frames=micro_batch_frames,
                auto_wrap_policy=auto_wrap_policy,
                samples=samples,
                sample_rows=sample_rows,
                sample_frames=sample_frames,
                adapter=None if settings is None else settings.to_dict(),
            ),
        )
    return plan


def speech_tokenizer_bytes(model: str | os.PathLike | Mapping[str, Any]) -> int:
    """fp32 bytes of a local pretrained directory's speech tokenizer (read from the safetensors
    header, no weights loaded); 0 when ``model`` is not a local directory."""
    if isinstance(model, Mapping):
        return 0
    path = Path(str(model)).expanduser() / "speech_tokenizer" / "model.safetensors"
    if not path.is_file():
        return 0
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return 4 * sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def _advice(config: dict, plan: MemoryPlan, settings: dict) -> list[str]:
    """Options that make it fit, cheapest first, applied cumulatively until it fits."""

    advice: list[str] = []
    current = plan

    def attempt(text: str, **change) -> bool:
        nonlocal current
        trial = plan_memory(config, **{**settings, **change}, advise=False)
        advice.append(
            f"{text}: {current.total / GiB:.1f} -> {trial.total / GiB:.1f} GiB per GPU"
            + (" (fits)" if trial.fits else "")
        )
        settings.update(change)
        current = trial
        return trial.fits

    if _checkpointed(settings["activation_checkpointing"]) != (True, True) and attempt(
        "turn on activation checkpointing (strategy activation_checkpointing_policy: both "
        "decoder-layer classes; costs ~30% more compute)",
        activation_checkpointing=True,
    ):
        return advice
    if (
        settings["sharding"] != "FULL_SHARD"
        and settings["gpus"] > 1
        and attempt("use sharding_strategy FULL_SHARD", sharding="FULL_SHARD")
    ):
        return advice
    if (
        settings.get("adapter") is None
        and not matches(TEXT_EMBEDDING + ".weight", settings["freeze"])
        and attempt(
            f"freeze {TEXT_EMBEDDING} (model.freeze; 311M parameters in the released models, rarely "
            "worth training for a new voice)",
            freeze=settings["freeze"] + [TEXT_EMBEDDING],
        )
    ):
        return advice
    # More GPUs: an alternative, not applied to the steps that follow.
    for n in (2, 4, 8, 16, 32, 64, 128):
        if n > settings["gpus"]:
            trial = plan_memory(config, **{**settings, "gpus": n, "sharding": "FULL_SHARD"}, advise=False)
            if trial.fits:
                advice.append(f"or use {n} GPUs with FULL_SHARD: {trial.total / GiB:.1f} GiB per GPU (fits)")
                break
    if not settings["cpu_offload"] and attempt(
        "turn on cpu_offload (parameters, gradients and AdamW state in host RAM; much slower steps)", cpu_offload=True
    ):
        return advice
    lo, hi = 0, settings["micro_batch_frames"]
    while hi - lo > 1:  # the largest micro-batch that fits
        mid = (lo + hi) // 2
        if plan_memory(config, **{**settings, "micro_batch_frames": mid}, advise=False).fits:
            lo = mid
        else:
            hi = mid
    if lo >= 1:
        attempt(
            f"lower data.max_frames_per_batch to {lo} (raise accumulate_grad_batches to keep the global batch)",
            micro_batch_frames=lo,
        )
    else:
        advice.append("it does not fit even with all of the above: use GPUs with more memory")
    return advice


# -- from a LightningCLI YAML -----------------------------------------------------------------
def _section(cfg: Mapping[str, Any], key: str) -> dict:
    sec = cfg.get(key) or {}
    if isinstance(sec, Mapping) and isinstance(sec.get("init_args"), Mapping):
        return {**{k: v for k, v in sec.items() if k not in ("init_args", "class_path")}, **sec["init_args"]}
    return dict(sec) if isinstance(sec, Mapping) else {}


def _devices(trainer: Mapping[str, Any]) -> int | None:
    devices = trainer.get("devices", "auto")
    nodes = int(trainer.get("num_nodes", 1) or 1)
    if isinstance(devices, (list, tuple)):
        return len(devices) * nodes
    if isinstance(devices, str):
        if "," in devices:
            return len([d for d in devices.split(",") if d.strip()]) * nodes
        if devices.strip().lstrip("-").isdigit():
            devices = int(devices)
        else:
            return None
    devices = int(devices)
    return None if devices < 0 else devices * nodes


def plan_from_config(
    config_yaml_path: str | os.PathLike,
    gpu_memory_gb: float,
    *,
    gpus: int | None = None,
) -> MemoryPlan:
    """Plan a LightningCLI config: the pretrained model (``data.pretrained``), ``model.freeze``,
    ``trainer.devices`` x ``num_nodes`` (or ``gpus``), ``trainer.precision``, the strategy's
    sharding, cpu_offload, activation checkpointing and wrap policy, and
    ``data.max_frames_per_batch``. Plain ``ddp`` (or several devices with no strategy) is planned
    as NO_SHARD without checkpointing."""
    import yaml

    from tts_lightning.distributed.fsdp import DEFAULT_CHECKPOINT

    path = Path(config_yaml_path)
    cfg = yaml.safe_load(path.read_text()) or {}
    data, model_sec, trainer = _section(cfg, "data"), _section(cfg, "model"), dict(cfg.get("trainer") or {})
    pretrained = data.get("pretrained") or model_sec.get("pretrained")
    if not pretrained:
        raise ValueError(f"{path}: no data.pretrained (or model.pretrained)")
    if not Path(str(pretrained)).expanduser().is_absolute() and not _HUB_ID.match(str(pretrained)):
        candidate = path.parent / str(pretrained)
        if not Path(str(pretrained)).exists() and candidate.exists():
            pretrained = str(candidate)
    n = gpus if gpus is not None else _devices(trainer)
    if n is None:
        raise ValueError(f"{path}: trainer.devices is {trainer.get('devices', 'auto')!r}; pass the GPU count")
    precision = str(trainer.get("precision", "32-true"))
    precision = {
        "bf16-mixed": "bf16-mixed",
        "16-mixed": "bf16-mixed",
        "bf16": "bf16-mixed",
        "32-true": "32-true",
        "32": "32-true",
    }.get(precision)
    if precision is None:
        raise ValueError(
            f"{path}: trainer.precision {trainer.get('precision')!r} is not planned (bf16-mixed or 32-true)"
        )
    strategy = trainer.get("strategy", "auto")
    wrap = None
    if isinstance(strategy, Mapping):
        args = dict(strategy.get("init_args") or {})
        ours = str(strategy.get("class_path", "")).endswith("Qwen3TTSFSDPStrategy")
        sharding = str(args.get("sharding_strategy", "FULL_SHARD"))
        offload = bool(args.get("cpu_offload", False))
        policy = args.get("activation_checkpointing_policy")
        ckpt = list(DEFAULT_CHECKPOINT) if (policy is None and ours) else list(policy or [])
        wrap = args.get("auto_wrap_policy")
        if wrap is None and not ours:
            wrap = []  # Lightning's FSDPStrategy without a policy: one unit, the root
    elif str(strategy).lower().startswith("fsdp"):
        sharding, offload, ckpt, wrap = "FULL_SHARD", False, [], []
    else:  # ddp, auto, single device
        sharding, offload, ckpt = "NO_SHARD", False, []
    if sharding == "HYBRID_SHARD":
        raise ValueError(f"{path}: HYBRID_SHARD is not planned (plan FULL_SHARD with the GPUs of one node)")
    freeze = model_sec.get("freeze", list(DEFAULT_FREEZE))
    adapter = model_sec.get("adapter")
    if isinstance(adapter, Mapping) and isinstance(adapter.get("init_args"), Mapping):
        adapter = adapter["init_args"]
    frames = data.get("max_frames_per_batch") or 2000
    samples = next(
        (
            c
            for c in trainer.get("callbacks") or []
            if isinstance(c, Mapping) and str(c.get("class_path", "")).endswith("SpeakerSamplesCallback")
        ),
        None,
    )
    sample_args = dict((samples or {}).get("init_args") or {})
    return plan_memory(
        str(pretrained),
        gpus=n,
        gpu_memory_gb=gpu_memory_gb,
        sharding=sharding,
        precision=precision,
        activation_checkpointing=ckpt,
        cpu_offload=offload,
        freeze=list(freeze or []),
        micro_batch_frames=int(frames),
        auto_wrap_policy=wrap,
        samples=samples is not None,
        sample_frames=int(sample_args.get("max_new_tokens", 240)),
        sample_rows=len(sample_args.get("texts") or (0, 0)) * max(1, len(sample_args.get("speakers") or (0, 0))),
        adapter=dict(adapter) if isinstance(adapter, Mapping) else None,
    )
