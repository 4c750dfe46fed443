"""Put a checkpoint's weights into Qwen3-TTS without ever holding a second copy of the model.

The model is built with its parameters on the meta device (no memory, no random init); buffers,
such as the MRoPE ``inv_freq``, are computed for real from the config as usual. Each module's
parameters are then materialized on the target device and filled tensor by tensor from the
safetensors files, converted to fp32 as they are read. Peak memory: the fp32 model plus one tensor.

Under FSDP, `Qwen3TTSFSDPStrategy` hands `MetaWeights.materialize` to FSDP as ``param_init_fn``, so
each unit is materialized just before it is sharded: global rank 0 reads, every other rank receives
the same bytes by a broadcast on the root device, and no rank holds more than one unsharded unit.
Units are materialized in the same order on every rank, so the broadcasts always pair up.

Under FSDP2 (`Qwen3TTSFSDP2Strategy`), ``fully_shard`` is applied to the meta model first, then each
rank's shards are allocated and `MetaWeights.fill_sharded` fills them tensor by tensor: rank 0 reads
one full tensor and scatters it (``distribute_tensor(src_data_rank=0)``). The shards keep the dtype
their meta parameter had when it was sharded, so a LoRA run's frozen base gets its storage dtype
on the meta device first (`MetaWeights.cast_frozen`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import torch
from torch import nn

from tts_lightning.model.pretrained import PretrainedError, PretrainedInfo, load_config


class WeightReader:
    """The tensors of a pretrained directory's safetensors file(s), read one at a time.

    Each read opens the file and closes it again: safetensors maps the whole file, and a mapping
    kept open would hold every page read so far in this process's resident memory."""

    def __init__(self, info: PretrainedInfo) -> None:
        from safetensors import safe_open

        index = info.path / "model.safetensors.index.json"
        if index.is_file():
            file_of = json.loads(index.read_text())["weight_map"]
        else:
            with safe_open(str(info.path / "model.safetensors"), framework="pt") as f:
                file_of = {key: "model.safetensors" for key in f.keys()}
        self.path = info.path
        self.file_of: dict[str, str] = dict(file_of)

    def keys(self) -> set[str]:
        return set(self.file_of)

    def read(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.path / self.file_of[key]), framework="pt") as f:
            return f.get_tensor(key)

    def read_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of tensor ``key``: only their bytes are read."""
        from safetensors import safe_open

        with safe_open(str(self.path / self.file_of[key]), framework="pt") as f:
            return f.get_slice(key)[start:stop]


def build_empty_model(info: PretrainedInfo, *, attn_implementation: str = "sdpa") -> nn.Module:
    """`Qwen3TTSForConditionalGeneration` with parameters on the meta device and real buffers."""
    from qwen_tts.core.models import Qwen3TTSForConditionalGeneration
    from transformers.integrations.accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return Qwen3TTSForConditionalGeneration(load_config(info, attn_implementation))


def build_model(info: PretrainedInfo, *, attn_implementation: str = "sdpa", load_weights: bool = True) -> nn.Module:
    """`Qwen3TTSForConditionalGeneration` in fp32 with the checkpoint's weights, read tensor by tensor
    into the parameters (no random init, no second copy: `MetaWeights`), or with random weights
    when ``load_weights`` is false. No speech tokenizer: training does not need it, and the official
    `from_pretrained` always loads it."""
    if not load_weights:
        from qwen_tts.core.models import Qwen3TTSForConditionalGeneration

        return Qwen3TTSForConditionalGeneration(load_config(info, attn_implementation)).float()
    model = build_empty_model(info, attn_implementation=attn_implementation)
    return MetaWeights(model, info).materialize_all(model)


class MetaWeights:
    """Materializes the meta parameters of a model built by `build_empty_model`, module by module,
    with the checkpoint's values in ``dtype``.

    ``materialize(module)`` is FSDP's ``param_init_fn`` contract: it only touches the parameters the
    module owns directly and ignores modules that are not part of the model (the LightningModule
    around it, metrics). With ``broadcast=True`` (a distributed run) global rank 0 reads and the
    other ranks receive; without it, every process reads for itself.
    """

    def __init__(
        self,
        model: nn.Module,
        info: PretrainedInfo,
        *,
        dtype: torch.dtype = torch.float32,
        adapter_seed: int = 0,
        frozen_dtype: torch.dtype | None = None,
    ):
        from tts_lightning.model.lora import checkpoint_key, is_adapter_key
        from tts_lightning.model.row_blocks import official_key, row_slices

        self.reader = WeightReader(info)
        # A row block of the text embedding reads its rows of the checkpoint's whole embedding.
        self.slices = row_slices(model)
        self.dtype = dtype
        self.frozen_dtype = frozen_dtype or dtype  # parameters with requires_grad=False (LoRA's base)
        self.adapter_seed = adapter_seed
        # Rows replaced as they are read, {parameter name: {row: value}} (a custom_voice run's new
        # speakers: `tts_lightning.model.custom_voice.initial_rows`).
        self.row_overrides: dict[str, dict[int, torch.Tensor]] = {}
        self.names = {module: name for name, module in model.named_modules()}
        # peft LoRA layers keep the base weight at `<layer>.base_layer.weight`; their adapters are
        # not in the checkpoint and are initialised instead (`tts_lightning.model.lora.init_adapter`).
        wanted = {
            checkpoint_key(official_key(name)) for name, _ in model.named_parameters() if not is_adapter_key(name)
        }
        missing, unexpected = sorted(wanted - self.reader.keys()), sorted(self.reader.keys() - wanted)
        if missing or unexpected:
            raise PretrainedError(
                f"{info.path}: weights do not match the config (missing {missing[:5]}, unexpected {unexpected[:5]})"
            )

    def materialize(self, module: nn.Module, *, device: torch.device | str = "cpu", broadcast: bool = False) -> None:
        name = self.names.get(module)
        if name is None:
            return
        reading = True
        if broadcast:
            reading = torch.distributed.get_rank() == 0
        device = torch.device(device)
        for param_name, param in list(module.named_parameters(recurse=False)):
            if not param.is_meta:
                continue
            key = f"{name}.{param_name}" if name else param_name
            dtype = self.dtype if param.requires_grad else self.frozen_dtype
            value = self._full_value(key, param.shape, dtype, device, reading)
            if broadcast:
                torch.distributed.broadcast(value, src=0)
            module._parameters[param_name] = nn.Parameter(value, requires_grad=param.requires_grad)

    def _full_value(
        self, key: str, shape: torch.Size, dtype: torch.dtype, device: torch.device, reading: bool
    ) -> torch.Tensor:
        """The full tensor of parameter ``key`` (a name in the model given to ``__init__``): read from
        the checkpoint (or initialised, for a LoRA adapter) when ``reading``, else uninitialised."""
        from tts_lightning.model.lora import checkpoint_key, init_adapter, is_adapter_key

        value = torch.empty(shape, dtype=dtype, device=device)
        if reading:
            if is_adapter_key(key):
                init_adapter(key, value, self.adapter_seed)
            elif key in self.slices:
                whole, start, stop = self.slices[key]
                value.copy_(self.reader.read_rows(checkpoint_key(whole), start, stop))
                for row, row_value in self.row_overrides.get(checkpoint_key(whole), {}).items():
                    if start <= row < stop:
                        value[row - start] = row_value
            else:
                value.copy_(self.reader.read(checkpoint_key(key)))
                for row, row_value in self.row_overrides.get(checkpoint_key(key), {}).items():
                    value[row] = row_value
        return value

    def cast_frozen(self, model: nn.Module) -> int:
        """Re-register the frozen (``requires_grad=False``) meta parameters of ``model`` in
        ``frozen_dtype``, still on the meta device; return how many changed. For FSDP2, before
        ``fully_shard``: its shards are allocated in the dtype the parameter was sharded with, and it
        needs a uniform dtype only among the trainable parameters of a unit, so a bf16 frozen base
        can share a unit with fp32 adapters. (FSDP1 materializes each dtype itself.)"""
        return self.cast_meta(model, trainable=False)

    def cast_meta(self, model: nn.Module, *, trainable: bool = True) -> int:
        """Re-register the meta parameters of ``model`` in the dtype they are stored in (``dtype``,
        or ``frozen_dtype`` for frozen ones; only the frozen ones unless ``trainable``), still on the
        meta device; return how many changed. bf16 weights (`tts_lightning.model.optimizers`)."""
        changed: dict[int, nn.Parameter] = {}  # a parameter shared by two modules stays shared
        for module in model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                dtype = self.dtype if param.requires_grad else self.frozen_dtype
                if not param.is_meta or (param.requires_grad and not trainable) or param.dtype == dtype:
                    continue
                if id(param) not in changed:
                    changed[id(param)] = nn.Parameter(
                        torch.empty(param.shape, dtype=dtype, device="meta"), requires_grad=param.requires_grad
                    )
                module._parameters[name] = changed[id(param)]
        return len(changed)

    def fill_sharded(self, model: nn.Module, *, device: torch.device | str, broadcast: bool) -> None:
        """Fill the parameters of ``model`` (the model given to ``__init__``) after FSDP2's
        ``fully_shard`` and ``to_empty``: each parameter is a DTensor shard (or a plain tensor, left
        outside every unit). Global rank 0 reads one full tensor at a time on ``device`` and
        ``distribute_tensor(src_data_rank=0)`` scatters it, so each rank keeps only its shard; the
        other ranks hold one uninitialised full-size receive buffer at a time. Parameters keep the
        dtype they were sharded with. Every rank must call this, in the same order (it does: the
        parameters are walked in registration order)."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        device = torch.device(device)
        reading = not broadcast or torch.distributed.get_rank() == 0
        with torch.no_grad():
            for key, param in model.named_parameters():
                full = self._full_value(key, param.shape, param.dtype, device, reading)
                if isinstance(param, DTensor):
                    shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=0)
                    param.to_local().copy_(shard.to_local())
                    del shard
                else:
                    if broadcast:
                        torch.distributed.broadcast(full, src=0)
                    param.copy_(full)
                del full

    def materialize_all(self, model: nn.Module, *, device: torch.device | str = "cpu") -> nn.Module:
        """Every parameter read onto ``device``, and the buffers (built on the CPU: the MRoPE
        ``inv_freq``, which the talker's rotary embedding does not move itself) moved there too."""
        with torch.no_grad():
            for module in model.modules():
                self.materialize(module, device=device)
        return model.to(device)


def copy_model(
    model: nn.Module,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    state: Mapping[str, torch.Tensor] | None = None,
) -> nn.Module:
    """A plain, frozen copy of ``model`` in ``dtype`` on ``device``, built from its parameters as they
    are now (peft LoRA adapters merged into their base weights). One parameter is copied at a time,
    straight into its place (the text embedding's row blocks too, never joined first), so the copy
    is the only extra memory (plus one merged weight at a time with LoRA).

    ``state``: the full values to copy instead of the parameters' own, by ``model``'s parameter
    names (under FSDP, whose parameters are shards: the full state gathered to this rank's host
    memory, e.g. by ``get_model_state_dict(model, full_state_dict=True, cpu_offload=True)``). It is
    consumed: each entry is removed once copied, so the gathered state and the copy together hold
    about one model, not two (where both are in host memory: CPU runs)."""
    from transformers.integrations.accelerate import init_empty_weights

    from tts_lightning.model.lora import MergedWeights

    source = MergedWeights(model, state)  # plain names; LoRA adapters (if any) merged as each is read
    with init_empty_weights(include_buffers=False):
        copy = type(model)(model.config)
    with torch.no_grad():
        for prefix, module in copy.named_modules():  # each module once, so each key is read once
            for name, empty in list(module.named_parameters(recurse=False)):
                key = f"{prefix}.{name}" if prefix else name
                if key not in source:
                    raise KeyError(f"the weights to copy lack {key!r}")
                value = torch.empty(empty.shape, dtype=dtype, device=device)
                source.copy_into(key, value, release=state is not None)
                module._parameters[name] = nn.Parameter(value, requires_grad=False)
    return copy.to(device).eval()
