"""Checkpoints of quantized optimizer state (torchao's AdamW8bit / AdamW4bit): saved and resumed per rank.

Why not as other optimizer state: torchao quantizes each rank's *local* piece of a parameter in
blocks of 256 (8-bit) or 128 (4-bit) values counted from that piece's first value, with one fp32
scale per block, and only pieces of at least 4096 values that divide into whole blocks (smaller
ones keep plain moments). Under FSDP a piece starts wherever the shard boundary falls, so blocks do
not line up with the parameter, one rank may hold a quantized piece of a parameter and another a
plain one, and FSDP1's own state dicts fail on them (``aten.cat`` is not implemented). Cutting them
into the parameter-shaped boxes of `tts_lightning.distributed.lean_state` is impossible, and
dequantizing to fp32 is not exact on reload (a block whose largest value is negative does not
requantize to the same codes). So each rank saves its own state as plain tensors: the codes
(uint8), the block scales (fp32) and the signedness of each quantized moment, the other values as
they are, and each group's learning rate, keyed by the parameter's index in the optimizer:

- sharded checkpoints: keys ``optimizer_N.rank_local.rank<R>.state.<index>.<name>[.codes|.scale|...]``,
  written by rank R alone (a plain tensor's key is unique to its rank);
- full checkpoints: rank 0 gathers every rank's state and writes them under
  ``rank_local_optimizer_states`` (``optimizer_states`` stays an empty list, so Lightning's loader
  reads the weights only).

Resuming needs the same world size and sharding (the pieces are the same): anything else is
refused with a ConfigError. The weights are saved as usual; export and `load_from_checkpoint` read
only them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tts_lightning.errors import ConfigError
from tts_lightning.model.optimizers import holds_rank_local_state, local_tensor

RANK_LOCAL = "rank_local"
FULL_KEY = "rank_local_optimizer_states"


def local_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's optimizer state as nested dicts of plain tensors (views, no copies)."""
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit

    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[str, Any] = {}
    for index, param in enumerate(params):
        values = optimizer.state.get(param)
        if not values:
            continue
        entry: dict[str, Any] = {}
        for name, value in values.items():
            value = local_tensor(value)
            if isinstance(value, (OptimState8bit, OptimState4bit)):
                bits = 8 if isinstance(value, OptimState8bit) else 4
                entry[name] = {
                    "codes": value.codes,
                    "scale": value.scale,
                    "signed": torch.tensor(bool(value.signed)),
                    "bits": torch.tensor(bits),
                }
            else:
                entry[name] = value
        state[str(index)] = entry
    lr = {str(g): torch.as_tensor(group["lr"]).detach().clone() for g, group in enumerate(optimizer.param_groups)}
    return {"state": state, "lr": lr}


def _rebuild(saved: Any, param: Tensor) -> Tensor:
    """A saved value as the optimizer holds it for ``param`` (quantized, a DTensor under FSDP2)."""
    from torch.distributed.tensor import DTensor

    local = local_tensor(param.detach())
    if isinstance(saved, dict):
        from torchao.optim import subclass_4bit, subclass_8bit

        signed = bool(saved["signed"])
        codes, scale = saved["codes"].to(local.device), saved["scale"].to(local.device)
        if int(saved["bits"]) == 8:
            qmap = subclass_8bit.get_qmap_signed() if signed else subclass_8bit.get_qmap_unsigned()
            table = torch.tensor(qmap, dtype=torch.float32, device=local.device)
            value: Tensor = subclass_8bit.OptimState8bit(
                codes.view(local.shape), scale, table, signed, dtype=local.dtype
            )
        else:
            qmap = subclass_4bit.get_qmap_signed() if signed else subclass_4bit.get_qmap_unsigned()
            table = torch.tensor(qmap, dtype=torch.float32, device=local.device)
            value = subclass_4bit.OptimState4bit(codes, scale, table, signed, local.shape, dtype=local.dtype)
    else:
        value = saved.to(local.device)
    if isinstance(param, DTensor):
        value = DTensor.from_local(
            value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return value


def restore(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Put a `local_state` back into ``optimizer`` (the same parameters, the same local pieces)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, entry in saved["state"].items():
        param = params[int(index)]
        if any(_saved_numel(v) != local_tensor(param).numel() for n, v in entry.items() if n != "step"):
            raise ConfigError(
                "the checkpoint's quantized optimizer state was saved with another sharding: resume with the "
                "world size and strategy settings it was saved with"
            )
        optimizer.state[param] = {
            name: value.clone() if name == "step" else _rebuild(value, param) for name, value in entry.items()
        }
    for g, group in enumerate(optimizer.param_groups):
        lr = saved["lr"][str(g)]
        if isinstance(group["lr"], Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = float(lr)


def _saved_numel(saved: Any) -> int:
    """The number of values a saved moment holds (4-bit codes pack two per byte)."""
    if isinstance(saved, dict):
        return saved["codes"].numel() * (8 // int(saved["bits"]))
    return saved.numel()


def gather_full(optimizer: torch.optim.Optimizer, rank: int, world_size: int) -> dict[str, Any]:
    """Every rank's `local_state` (on the CPU) on global rank 0, for a one-file checkpoint; {} elsewhere."""
    cpu = _to_cpu(local_state(optimizer))
    if world_size == 1:
        return {RANK_LOCAL: {"rank0": cpu}}
    gathered = gather_on_rank0(cpu, rank, world_size)
    if gathered is None:
        return {}
    return {RANK_LOCAL: {f"rank{r}": s for r, s in enumerate(gathered)}}


# Keyed by the default group itself (weakly): a re-initialised default group gets its own.
_HOST_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def host_group() -> Any:
    """A process group over all ranks that serves tensors in host memory: None when the default one
    does (gloo; ``cpu_offload``'s "cpu:gloo,cuda:nccl"), else a gloo group over the same ranks, made
    once per default group (every rank calls this together)."""
    dist = torch.distributed
    backend = str(dist.get_backend())
    if backend == "gloo" or "cpu:" in backend:
        return None
    world = dist.group.WORLD
    if world not in _HOST_GROUPS:
        _HOST_GROUPS[world] = dist.new_group(backend="gloo")
    return _HOST_GROUPS[world]


def gather_on_rank0(value: Any, rank: int, world_size: int) -> list[Any] | None:
    """Every rank's ``value`` (a host object) on global rank 0 (None elsewhere), over `host_group`
    (every rank calls this together). Over NCCL alone, ``gather_object`` stages each rank's pickled
    value on its GPU and rank 0 receives all of them there: about the whole 8-bit optimizer state
    at every full save. Rehearsed on CPU with a process group whose only backend serves the GPU
    (tests/distributed/test_process_group.py)."""
    gathered: list[Any] | None = [None] * world_size if rank == 0 else None
    torch.distributed.gather_object(value, gathered, dst=0, group=host_group())
    return gathered


def prepare_full_saves(strategy: Any) -> None:
    """At setup: a run that will gather its quantized optimizer state for one-file checkpoints makes
    the group it gathers over now, so that a cluster where gloo cannot connect (NCCL runs across
    nodes) fails at the start, not at the first save. Not run with NCCL here: `host_group`'s
    decision is rehearsed in tests/distributed/test_process_group.py."""
    if strategy.world_size > 1 and not strategy._writes_sharded() and rank_local(strategy):
        host_group()


def _to_cpu(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _to_cpu(v) for k, v in tree.items()}
    return tree.detach().cpu().clone() if tree.device.type != "cpu" else tree.detach().clone()


def load_sharded(path: Path, index: int, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s saved state of optimizer ``index`` from a sharded checkpoint, as `local_state` nests it."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = f"optimizer_{index}.{RANK_LOCAL}.rank{rank}."
    stored = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    flat = {
        key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for key, meta in stored.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    if not flat:
        raise ConfigError(
            f"{path} holds no quantized optimizer state for rank {rank}: it was saved with another optimizer "
            "(model.optimizer) or world size; resume with the ones it was trained with"
        )
    dcp_load(flat, checkpoint_id=str(path))
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        node = nested
        *parents, leaf = key[len(prefix) :].split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    nested.setdefault("state", {})
    return nested


def from_full(checkpoint: dict[str, Any], index: int, rank: int) -> dict[str, Any]:
    states = checkpoint.get(FULL_KEY)
    saved = None if not states or index >= len(states) else states[index].get(RANK_LOCAL, {}).get(f"rank{rank}")
    if saved is None:
        raise ConfigError(
            f"the checkpoint holds no quantized optimizer state for rank {rank}: it was saved with another optimizer "
            "(model.optimizer) or world size; resume with the ones it was trained with"
        )
    return saved


def rank_local(strategy: Any) -> bool:
    """Whether any of ``strategy``'s optimizers keeps quantized (per-rank) state."""
    return any(holds_rank_local_state(getattr(o, "_optimizer", o)) for o in strategy.optimizers)


def optimizer_state(strategy: Any, optimizer: Any) -> dict[str, Any] | None:
    """What a checkpoint of ``strategy`` holds of ``optimizer``'s quantized state; None for other optimizers."""
    inner = getattr(optimizer, "_optimizer", optimizer)
    if not holds_rank_local_state(inner):
        return None
    if strategy._writes_sharded():
        return {RANK_LOCAL: {f"rank{strategy.global_rank}": local_state(inner)}}
    return gather_full(inner, strategy.global_rank, strategy.world_size)


def prepare_full(strategy: Any, checkpoint: dict[str, Any]) -> None:
    """Before a one-file checkpoint is written: the gathered states move to their own key."""
    if rank_local(strategy):
        checkpoint[FULL_KEY] = checkpoint.pop("optimizer_states", [])
        checkpoint["optimizer_states"] = []  # Lightning's loaders then read the weights only


def load_checkpoint(
    strategy: Any, checkpoint_path: Any, load_weights: Callable[[Any], dict[str, Any]]
) -> dict[str, Any]:
    """``load_weights(path)`` (the strategy's own loading), with the quantized optimizer state loaded here."""
    if not rank_local(strategy):
        return load_weights(checkpoint_path)
    from lightning.pytorch.trainer.states import TrainerFn

    optimizers = strategy._optimizers
    strategy._optimizers = []  # the strategy's loading reads the weights only
    try:
        checkpoint = load_weights(checkpoint_path)
    finally:
        strategy._optimizers = optimizers
    module = strategy.lightning_module
    if module is None or module.trainer.state.fn != TrainerFn.FITTING:
        return checkpoint
    path = Path(strategy.check_on_every_node(checkpoint_path))
    for index, optimizer in enumerate(optimizers):
        inner = getattr(optimizer, "_optimizer", optimizer)
        if path.is_dir():
            saved = load_sharded(path, index, strategy.global_rank)
        else:
            saved = from_full(checkpoint, index, strategy.global_rank)
        restore(inner, saved)
    checkpoint.pop(FULL_KEY, None)
    return checkpoint
