"""FSDP1 sharded checkpoints saved and loaded lean (tts_lightning.distributed.lean_state): the same
keys, shapes and dtypes as FSDP's own sharded state dicts; every saved tensor a view of the rank's
own shards (nothing gathered, nothing copied); read back bit-exactly, from a lean checkpoint or one
of FSDP's own, on 2 ranks and on 1 (another world size). Spawned gloo ranks, a small model with an
embedding unit, linear units, a 3-D weight and a buffer."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

pytestmark = pytest.mark.slow  # spawned process groups
D, V, OUT = 24, 97, 13


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, 3 * D), nn.Linear(3 * D, D)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.conv = nn.Conv1d(D, 7, 3, padding=1)  # a 3-D weight of odd sizes
        self.head = nn.Linear(7, OUT)
        self.register_buffer("scale", torch.ones(7))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.conv(x.transpose(1, 2)).transpose(1, 2) * self.scale)


class Outer(nn.Module):  # the LightningModule's place: keys "model.<name>"
    def __init__(self):
        super().__init__()
        self.model = Net()

    def forward(self, ids):
        return self.model(ids)


def _build(seed):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(seed)
    model = FSDP(
        Outer(), auto_wrap_policy=ModuleWrapPolicy({Block, nn.Embedding}), use_orig_params=True, device_id="cpu"
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def _train(model, optimizer, steps=2):
    for i in range(steps):
        g = torch.Generator().manual_seed(100 * dist.get_rank() + i)
        ids = torch.randint(0, V, (2, 9), generator=g)
        F.cross_entropy(model(ids).flatten(0, 1), torch.randint(0, OUT, (18,), generator=g)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _full(model, optimizer):
    """Every tensor at full size on rank 0 (FSDP's own FULL_STATE_DICT), the reference."""
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.state_dict_type(
        model,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(rank0_only=True),
        FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True),
    ):
        weights, optim = model.state_dict(), FSDP.optim_state_dict(model, optimizer)
    if dist.get_rank() != 0:
        return None
    clone = {k: v.clone() for k, v in weights.items()}
    return clone, {k: {n: v.clone() for n, v in s.items()} for k, s in optim["state"].items()}


def _same(a, b) -> bool:
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _ranks(rank, world, store, folder, results):
    from torch.distributed.checkpoint import FileSystemReader, save
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType

    from tts_lightning.distributed.lean_state import LeanShards, load, model_state_dict, optimizer_state_dict

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        out = {}
        if world == 2:  # write: lean, and FSDP's own
            model, optimizer = _build(0)
            _train(model, optimizer)
            reference = _full(model, optimizer)
            shards = LeanShards(model)
            weights, optim = model_state_dict(shards), optimizer_state_dict(shards, optimizer)
            # Nothing copied: each saved piece lies in the rank's flat shards or the optimizer's tensors.
            sources = [h.flat_param._local_shard for h, _ in shards.params.values()]
            sources += [v for state in optimizer.state.values() for v in state.values() if v.dim() > 0]
            spans = [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in sources]
            saved = [v for v in weights.values() if hasattr(v, "local_shards")]
            saved += [v for state in optim["state"].values() for v in state.values() if hasattr(v, "local_shards")]
            pieces = [shard.tensor.untyped_storage() for v in saved for shard in v.local_shards()]
            out["no_copy"] = bool(pieces) and all(
                any(start <= p.data_ptr() and p.data_ptr() + p.nbytes() <= start + n for start, n in spans)
                for p in pieces
            )
            save({"model": weights, "optimizer_0": optim}, checkpoint_id=f"{folder}/lean")
            with FSDP.state_dict_type(
                model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(), ShardedOptimStateDictConfig()
            ):
                save(
                    {"model": model.state_dict(), "optimizer_0": FSDP.optim_state_dict(model, optimizer)},
                    checkpoint_id=f"{folder}/fsdp",
                )
            if rank == 0:
                torch.save(reference, f"{folder}/reference.pt")
                layouts = [
                    FileSystemReader(f"{folder}/{n}").read_metadata().state_dict_metadata for n in ("lean", "fsdp")
                ]
                out["layout"] = [
                    {
                        k: (tuple(getattr(m, "size", ())), str(getattr(getattr(m, "properties", None), "dtype", "")))
                        for k, m in layout.items()
                    }
                    for layout in layouts
                ]
        dist.barrier()
        for name in ("lean", "fsdp"):  # read back into a freshly built model
            model, optimizer = _build(1)
            _train(model, optimizer, steps=1)  # some state of its own, to be replaced
            shards = LeanShards(model)
            keys = set(model_state_dict(shards))
            load(shards, f"{folder}/{name}", keys=keys, optimizers=[optimizer])
            loaded = _full(model, optimizer)
            if rank == 0:
                weights, optim = torch.load(f"{folder}/reference.pt")
                out[name] = (
                    _same(weights, loaded[0])
                    and set(optim) == set(loaded[1])
                    and all(_same(optim[k], loaded[1][k]) for k in optim)
                )
        results[(world, rank)] = out
    finally:
        dist.destroy_process_group()


def _run(world, folder, results):
    with tempfile.NamedTemporaryFile() as store:
        # Spawned, not forked: the ranks run backward, which a child forked from a process whose autograd
        # engine has started its threads refuses (whichever test ran before in this pytest worker).
        mp.start_processes(_ranks, args=(world, store.name, folder, results), nprocs=world, start_method="spawn")


def test_lean_checkpoints_match_fsdp_and_read_back_exactly(tmp_path):
    with mp.Manager() as manager:
        results = manager.dict()
        _run(2, str(tmp_path), results)
        _run(1, str(tmp_path), results)  # another world size (NO_SHARD) reads what 2 ranks wrote
        results = dict(results)
    lean, fsdp = results[(2, 0)]["layout"]
    assert lean == fsdp and any(k.startswith("optimizer_0.state.model.") for k in lean)  # same keys, shapes, dtypes
    assert results[(2, 0)]["no_copy"] and results[(2, 1)]["no_copy"]
    for world in (2, 1):
        assert results[(world, 0)]["lean"] and results[(world, 0)]["fsdp"], results
    assert os.path.getsize(tmp_path / "reference.pt") > 0
