"""Put a checkpoint's weights into Qwen3-TTS without ever holding a second copy of the model.

The model is built with its parameters on the meta device (no memory, no random init); buffers,
such as the MRoPE ``inv_freq``, are computed for real from the config as usual. Each module's
parameters are then materialized on the target device and filled tensor by tensor from the
safetensors files, converted to fp32 as they are read. Peak memory: the fp32 model plus one tensor.

Under FSDP, `Qwen3TTSFSDPStrategy` hands `MetaWeights.materialize` to FSDP as ``param_init_fn``, so
each unit is materialized just before it is sharded: global rank 0 reads, every other rank receives
the same bytes by a broadcast on the root device, and no rank holds more than one unsharded unit.
Units are materialized in the same order on every rank, so the broadcasts always pair up.
"""

from __future__ import annotations

import json

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


def build_empty_model(info: PretrainedInfo, *, attn_implementation: str = "sdpa") -> nn.Module:
    """`Qwen3TTSForConditionalGeneration` with parameters on the meta device and real buffers."""
    from qwen_tts.core.models import Qwen3TTSForConditionalGeneration
    from transformers.integrations.accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return Qwen3TTSForConditionalGeneration(load_config(info, attn_implementation))


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

        self.reader = WeightReader(info)
        self.dtype = dtype
        self.frozen_dtype = frozen_dtype or dtype  # parameters with requires_grad=False (LoRA's base)
        self.adapter_seed = adapter_seed
        self.names = {module: name for name, module in model.named_modules()}
        # peft LoRA layers keep the base weight at `<layer>.base_layer.weight`; their adapters are
        # not in the checkpoint and are initialised instead (`tts_lightning.model.lora.init_adapter`).
        wanted = {checkpoint_key(name) for name, _ in model.named_parameters() if not is_adapter_key(name)}
        missing, unexpected = sorted(wanted - self.reader.keys()), sorted(self.reader.keys() - wanted)
        if missing or unexpected:
            raise PretrainedError(
                f"{info.path}: weights do not match the config (missing {missing[:5]}, unexpected {unexpected[:5]})"
            )

    def materialize(self, module: nn.Module, *, device: torch.device | str = "cpu", broadcast: bool = False) -> None:
        from tts_lightning.model.lora import checkpoint_key, init_adapter, is_adapter_key

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
            value = torch.empty(param.shape, dtype=dtype, device=device)
            if reading:
                if is_adapter_key(key):
                    init_adapter(key, value, self.adapter_seed)
                else:
                    value.copy_(self.reader.read(checkpoint_key(key)))
            if broadcast:
                torch.distributed.broadcast(value, src=0)
            module._parameters[param_name] = nn.Parameter(value, requires_grad=param.requires_grad)

    def materialize_all(self, model: nn.Module, *, device: torch.device | str = "cpu") -> nn.Module:
        with torch.no_grad():
            for module in model.modules():
                self.materialize(module, device=device)
        return model


def copy_model(model: nn.Module, *, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """A plain, frozen copy of ``model`` in ``dtype`` on ``device``, built from its parameters as they
    are now (under FSDP: inside ``summon_full_params``, whose wrapper prefixes are dropped from the
    names; peft LoRA adapters merged into their base weights). One parameter is copied at a time, so
    the copy is the only extra memory (plus one merged weight at a time with LoRA)."""
    from transformers.integrations.accelerate import init_empty_weights

    from tts_lightning.model.lora import MergedWeights

    source = MergedWeights(model)  # plain names; LoRA adapters (if any) merged as each is read
    with init_empty_weights(include_buffers=False):
        copy = type(model)(model.config)
    with torch.no_grad():
        for prefix, module in copy.named_modules():
            for name, param in list(module.named_parameters(recurse=False)):
                value = source[f"{prefix}.{name}" if prefix else name].detach()
                module._parameters[name] = nn.Parameter(
                    value.to(device=device, dtype=dtype, copy=True), requires_grad=False
                )
    return copy.to(device).eval()
