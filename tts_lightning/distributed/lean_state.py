"""FSDP1 sharded checkpoints (``use_orig_params=True``) saved and loaded without an all-gather or a
copy: each rank hands torch.distributed.checkpoint views of its own shards.

Why: FSDP's own sharded state dicts copy every rank's chunk of every parameter and optimizer state
(12 of the 16 bytes per parameter of the model states, per rank), and its optimizer path first
gathers each unit's full state (2.5 GB of AdamW moments for the 311M text embedding): the released
0.6B on 2 CPU ranks was killed saving its first checkpoint. Loading gathered again.

How: FSDP1 shards a unit's flat parameter into equal contiguous pieces, so each rank holds a
contiguous range of each original parameter's row-major flattening; every rank can compute every
other rank's range (no communication). A range is cut into boxes of the parameter's own shape (at
most 2·ndim−1, split further to at most `CHUNK` elements), each a view of the local piece, and the
boxes of all ranks make a ShardedTensor. The keys, shapes and dtypes are the ones Lightning's
``state_dict_type="sharded"`` writes (``model.<fqn>``, ``optimizer_0.state.<fqn>.<name>``,
``optimizer_0.param_groups``): only how the chunks are cut differs, which torch.distributed.checkpoint
reads across at any world size, Lightning's own loader included, and `tts_lightning.model.checkpoint`
reads at the original shapes.

Private torch names used (torch 2.14; docs/architecture.md lists them): the flat parameter's
``_shard_param_infos``, ``_get_shard_metadata``, ``_local_shard``, ``_shapes``, ``_params``;
``_get_fqn_to_fsdp_param_info``; ``ShardedTensor._init_from_local_shards_and_global_metadata``
(builds the tensor without a collective). tests/distributed/test_lean_state.py compares keys,
shapes and values with FSDP's own state dicts.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

CHUNK = 4 * 2**20  # elements per stored box (16 MiB in fp32): bounds what the writer and reader hold at once


def boxes(shape: tuple[int, ...], start: int, end: int, cap: int = CHUNK) -> Iterator[tuple[tuple, tuple, int]]:
    """Boxes ``(offsets, sizes, flat_start)`` of a row-major ``shape`` covering its flat range
    ``[start, end)``, in order, none over ``cap`` elements (but one row of a dimension above it)."""
    if start >= end:
        return
    if len(shape) <= 1:
        for s in range(start, end, cap):
            yield ((s,), (min(end, s + cap) - s,), s) if shape else ((), (), s)
        return
    inner = math.prod(shape[1:])

    def within_row(row: int, lo: int, hi: int) -> Iterator[tuple[tuple, tuple, int]]:
        for offsets, sizes, flat in boxes(shape[1:], lo, hi, cap):
            yield (row, *offsets), (1, *sizes), row * inner + flat

    if start % inner:  # a partial first row
        row = start // inner
        stop = min(end, (row + 1) * inner)
        yield from within_row(row, start - row * inner, stop - row * inner)
        start = stop
    first, last = start // inner, end // inner  # whole rows [first, last)
    if last > first:
        if inner <= cap:
            step = cap // inner
            for row in range(first, last, step):
                yield (row, *([0] * (len(shape) - 1))), (min(step, last - row), *shape[1:]), row * inner
        else:
            for row in range(first, last):
                yield from within_row(row, 0, inner)
        start = last * inner
    if end > start:  # a partial last row
        yield from within_row(last, 0, end - last * inner)


def _alias(view: torch.Tensor) -> torch.Tensor:
    """The same memory as the contiguous ``view``, as a tensor whose storage is exactly its bytes:
    the checkpoint writer clones a tensor whose storage is larger than itself, and keeps the clone
    until the rank's file is closed (a full shard's worth by the end)."""
    size = view.element_size()
    storage = view.untyped_storage()[view.storage_offset() * size : (view.storage_offset() + view.numel()) * size]
    return torch.empty(0, dtype=view.dtype, device=view.device).set_(storage, 0, view.shape, view.stride())


class LeanShards:
    """The original parameters of an FSDP1 model (``use_orig_params=True``) and where each rank's
    piece of each lies; builds the ShardedTensors of views that save and load use."""

    def __init__(self, model: nn.Module) -> None:
        from torch.distributed.fsdp._optim_utils import _get_fqn_to_fsdp_param_info

        self.model = model
        self.params: dict[str, tuple[Any, int]] = {}  # fqn -> (flat-parameter handle, index in it)
        for fqn, info in _get_fqn_to_fsdp_param_info(model).items():
            self.params[fqn] = (info.handle, info.param_indices[fqn])
        self._ranges: dict[int, list[list[Any]]] = {}

    def parameter(self, fqn: str) -> nn.Parameter:
        handle, index = self.params[fqn]
        return handle.flat_param._params[index]

    def piece(self, fqn: str) -> torch.Tensor:
        """This rank's 1-D piece of parameter ``fqn``: a view of the local flat shard (empty if none)."""
        handle, index = self.params[fqn]
        flat = handle.flat_param
        base = flat._local_shard if handle.uses_sharded_strategy else flat.data
        info = flat._shard_param_infos[index]
        if not info.in_shard:
            return base.new_empty(0)
        return base[info.offset_in_shard : info.offset_in_shard + info.numel_in_shard]

    def _rank_ranges(self, handle) -> list[list[Any]]:
        """For each rank of ``handle``'s group, its shard infos (computed locally, once)."""
        if id(handle) not in self._ranges:
            flat = handle.flat_param
            if not handle.uses_sharded_strategy:
                self._ranges[id(handle)] = [list(flat._shard_param_infos)]
            else:
                size = flat._sharded_size.numel()
                world = handle.world_size
                self._ranges[id(handle)] = [
                    list(handle._get_shard_metadata(size * r, size * (r + 1) - 1)) for r in range(world)
                ]
        return self._ranges[id(handle)]

    def sharded(self, fqn: str, local: torch.Tensor) -> Any | None:
        """A ShardedTensor of parameter ``fqn``'s shape and ``local``'s dtype whose local shards are
        views of ``local`` (this rank's 1-D piece, or a tensor laid out as it); None when this rank
        holds none of it (a key without local shards must be left out, or the reader drops it and
        takes the whole checkpoint for an older layout)."""
        import torch.distributed as dist
        from torch.distributed._shard.metadata import ShardMetadata
        from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
        from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

        handle, index = self.params[fqn]
        shape = tuple(handle.flat_param._shapes[index])
        group = handle.process_group
        me = dist.get_rank(group)
        metadata, mine = [], []
        for rank, infos in enumerate(self._rank_ranges(handle)):
            info = infos[index]
            if not info.in_shard:
                continue
            start, end = info.intra_param_start_idx, info.intra_param_end_idx + 1
            placement = f"rank:{dist.get_global_rank(group, rank)}/{local.device}"
            for offsets, sizes, flat in boxes(shape, start, end):
                box = ShardMetadata(list(offsets), list(sizes), placement)
                metadata.append(box)
                if rank == me:
                    view = local.reshape(-1)[flat - start : flat - start + math.prod(sizes)].view(sizes)
                    mine.append(Shard(_alias(view), box))
        if not mine:
            return None
        # cpu_offload pins the local shard (FSDP1 on a GPU): ShardedTensor refuses properties that
        # disagree with its shards' pinning (CPU runs cannot pin: checked by benchmarks/gpu_check.sh).
        properties = TensorProperties(dtype=local.dtype, requires_grad=False, pin_memory=local.is_pinned())
        whole = ShardedTensorMetadata(shards_metadata=metadata, size=torch.Size(shape), tensor_properties=properties)
        return ShardedTensor._init_from_local_shards_and_global_metadata(mine, whole, process_group=group)


def buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The persistent buffers of an FSDP model by their state-dict names (wrappers removed)."""
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    found = {}
    for module_name, module in model.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                found[clean_tensor_name(f"{module_name}.{name}" if module_name else name)] = buffer
    return found


def model_state_dict(shards: LeanShards, keys: set[str] | None = None) -> dict[str, Any]:
    """The module state as Lightning's sharded FSDP1 checkpoints hold it (the parameters as
    ShardedTensors of views, the persistent buffers as they are), only ``keys`` when given."""
    state: dict[str, Any] = {}
    for fqn in shards.params:
        if keys is None or fqn in keys:
            value = shards.sharded(fqn, shards.piece(fqn))
            if value is not None:
                state[fqn] = value
    state.update({k: v for k, v in buffers(shards.model).items() if keys is None or k in keys})
    return state


def optimizer_state_dict(shards: LeanShards, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state as FSDP1's sharded optimizer state dict lays it out (keyed by parameter
    name), built from views of the optimizer's own tensors."""
    names = {id(shards.parameter(fqn)): fqn for fqn in shards.params}
    state: dict[str, Any] = {}
    for param, values in optimizer.state.items():
        fqn = names.get(id(param))
        if fqn is None or not values:
            continue
        entry = {}
        for name, value in values.items():
            if torch.is_tensor(value) and value.dim() > 0:
                sharded = shards.sharded(fqn, value)
                if sharded is not None:
                    entry[name] = sharded
            else:
                entry[name] = value  # the step count: the same on every rank that holds a piece
        state[fqn] = entry
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in group["params"]]}
        for group in optimizer.param_groups
    ]
    return {"state": state, "param_groups": groups}


def load(shards: LeanShards, path: Path, *, keys: set[str], optimizers: list[torch.optim.Optimizer]) -> None:
    """Read a sharded checkpoint (written lean, or by FSDP's own state dicts, at any world size)
    straight into this rank's shards (``keys`` of the module state) and into each optimizer's state,
    allocated here at the size of this rank's pieces."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    target: dict[str, Any] = {"model": model_state_dict(shards, keys)}
    fresh: list[dict[nn.Parameter, dict[str, torch.Tensor]]] = []
    for index, optimizer in enumerate(optimizers):
        prefix = f"optimizer_{index}.state."
        tensors: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
        views: dict[str, dict[str, Any]] = {}
        for key, meta in stored.items():
            if not key.startswith(prefix) or not isinstance(meta, TensorStorageMetadata):
                continue
            fqn, name = key[len(prefix) :].rsplit(".", 1)
            param, piece = shards.parameter(fqn), shards.piece(fqn)
            if piece.numel() == 0:
                continue  # none of it here: no state either (its step count may lie on another node)
            # Step counts (0-dim) on the host, where torch's and torchao's optimizers create them (fused
            # AdamW moves its own): on the GPU, reading one (bf16_sr's rounding seed) waits for it.
            value = torch.empty(
                piece.numel() if len(meta.size) else (),
                dtype=meta.properties.dtype,
                device=piece.device if len(meta.size) else "cpu",
            )
            tensors.setdefault(param, {})[name] = value.view(param.shape) if len(meta.size) else value
            views.setdefault(fqn, {})[name] = shards.sharded(fqn, value) if len(meta.size) else value
        groups = optimizer_state_dict(shards, optimizer)["param_groups"]
        target[f"optimizer_{index}"] = {"state": views, "param_groups": groups}
        fresh.append(tensors)
    dcp_load(target, checkpoint_id=str(path))
    for index, optimizer in enumerate(optimizers):
        saved_groups = target[f"optimizer_{index}"]["param_groups"]
        ids: dict[nn.Parameter, int] = {}
        groups = []
        for saved, group in zip(saved_groups, optimizer.param_groups):
            numbered = list(range(len(ids), len(ids) + len(group["params"])))
            ids.update(zip(group["params"], numbered))
            groups.append({**saved, "params": numbered})
        optimizer.load_state_dict(
            {"state": {ids[p]: values for p, values in fresh[index].items()}, "param_groups": groups}
        )
