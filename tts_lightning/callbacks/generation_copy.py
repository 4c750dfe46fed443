"""What sampling during training generates and decodes with: a plain copy of the model in the compute
dtype on rank 0 (gathered from the shards by every rank), and the speech tokenizer on the GPU only
while it decodes.

Under FSDP (either strategy, any sharding, one rank or many) every rank takes part in gathering
the full state into rank 0's host memory one unit (FSDP1) or parameter (FSDP2) at a time; rank 0
copies it into a fresh model in the run's compute dtype (bf16 under bf16-mixed: 3.6 GiB for the
1.7B, never the 7.2 GiB fp32 model) on its device, releases the host copy, and generates with no
collective inside generation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import lightning.pytorch as pl
import torch
from torch import Tensor, nn


@contextlib.contextmanager
def generation_model(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Iterator[nn.Module | None]:
    """Collective on all ranks: a plain model to generate with on global rank 0, None elsewhere.

    Under FSDP (either strategy, any sharding, one rank or many) every rank takes part in gathering
    the full state into rank 0's *host* memory one unit (FSDP1) or parameter (FSDP2) at a time
    (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``); rank 0 copies it into a
    fresh model in the run's compute dtype (bf16 under bf16-mixed) on its device, releasing the host
    copy as it goes: the GPU holds the copy (2 bytes per parameter) only while sampling, never a
    second fp32 model. FSDP1's NO_SHARD (one rank) holds the full parameters already: rank 0 copies
    them on the device, with no host copy. Generation then issues no collective at all.
    Without FSDP the module's own model is used, on rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel, ShardingStrategy

    from tts_lightning.model.generation import compute_dtype
    from tts_lightning.model.loading import copy_model

    plain = pl_module.model
    assert isinstance(plain, nn.Module)
    root: Any = trainer.strategy.model  # FSDP1's wrapper, FSDP2's sharded module or the plain one
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state: dict[str, Tensor] | None = None  # None: copy from the parameters themselves
    if isinstance(root, FSDPModule):  # FSDP2: the parameters are DTensor shards
        policy = getattr(trainer.strategy, "mixed_precision_policy", None)
        dtype = getattr(policy, "param_dtype", None) or compute_dtype(plain)
        state = cast("dict[str, Tensor]", get_model_state_dict(plain, options=options))
    elif isinstance(root, FullyShardedDataParallel):
        dtype = compute_dtype(plain)
        # NO_SHARD (FSDP1 at world size 1: the 1-GPU configs) keeps the full parameters on every
        # rank's device: rank 0 copies them there directly (`summon_full_params` gathers nothing
        # then, and presents the full-precision parameters under their own names), not through a
        # full fp32 state in host memory (3.4 GiB for the 0.6B at every round). Offloaded parameters
        # take the gathered path.
        if root.sharding_strategy != ShardingStrategy.NO_SHARD or root.cpu_offload.offload_params:
            # From the FSDP root (the LightningModule): its own unit holds parameters of the model
            # too. Keys are the LightningModule's ("model.talker...").
            prefix = "model."
            full = get_model_state_dict(root, options=options)
            state = {k[len(prefix) :]: cast(Tensor, v) for k, v in full.items() if k.startswith(prefix)}
            del full
    else:
        yield plain if trainer.is_global_zero else None
        return
    in_place = state is None  # NO_SHARD: the parameters themselves, full inside summon_full_params
    with FullyShardedDataParallel.summon_full_params(root, writeback=False) if in_place else contextlib.nullcontext():
        model = copy_model(plain, dtype=dtype, device=pl_module.device, state=state) if trainer.is_global_zero else None
    del state
    try:
        yield model
    finally:
        del model
        if pl_module.device.type == "cuda":
            torch.cuda.empty_cache()


@contextlib.contextmanager
def on_device(holder, device: torch.device | str) -> Iterator[None]:
    """Keep a model held in host memory except while it works on ``device``: ``holder`` has the
    ``model`` and the ``device`` its inputs follow (the speech tokenizer while it decodes, the
    samples' Whisper recognizer while it transcribes). Kept on rank 0's GPU they would hold its
    memory through training."""
    device = torch.device(device)
    if device.type == "cpu":
        yield
        return
    holder.model.to(device)
    holder.device = device
    try:
        yield
    finally:
        holder.model.to("cpu")
        holder.device = torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.empty_cache()
