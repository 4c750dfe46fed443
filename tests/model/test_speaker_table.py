"""The `speaker_embeddings` buffer that checkpoints and export carry is complete and identical on
every rank, even when each rank has seen only some of the speakers. The module syncs it with
all-reduces over the process group at its trainer's world size (`all_reduce_in_step`): DDP here,
FSDP in tests/distributed/setup_worker.py, one process below."""

import os
import socket
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tts_lightning import Qwen3TTSModule


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer(devices: int, **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        **kwargs,
    )


def _worker(rank, port, tiny_dir, table, out):
    torch.set_num_threads(1)
    # Launched from outside, as torchrun would: Lightning reads the ranks from the environment.
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "NODE_RANK": "0"}
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    trainer = _trainer(2, strategy="ddp")
    trainer.strategy.setup_environment()  # the process group, as fit starts it
    try:
        assert dist.is_initialized() and trainer.world_size == 2 and trainer.global_rank == rank
        module = Qwen3TTSModule(tiny_dir, speakers=["alice", "bob", "carol"])
        module.trainer = trainer
        # Rank 0 sees alice then alice again; rank 1 sees bob and carol, then carol.
        seen = [[0], [0]] if rank == 0 else [[1, 2], [2]]
        for indices in seen:
            batch = SimpleNamespace(speaker_index=torch.tensor(indices), speaker_embedding=table[indices])
            module._remember_speakers(batch)
        torch.save(module.speaker_embeddings, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # multi-process or a model build: about a minute
def test_every_rank_holds_every_speaker(tiny_dir, tmp_path):
    table = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)) * 3
    # Forked: this process has imported torch and Lightning already (a spawned one spends ~10 s on that).
    args = (_free_port(), str(tiny_dir), table, str(tmp_path))
    mp.start_processes(_worker, args=args, nprocs=2, join=True, start_method="fork")
    for rank in (0, 1):
        assert torch.equal(torch.load(tmp_path / f"rank{rank}.pt"), table)  # exact, not averaged


def test_single_process_fills_rows_as_seen(tiny_dir):
    table = torch.randn(2, 64)
    for trainer in (None, _trainer(1)):  # no trainer; a one-device run (world size 1: no reduction)
        module = Qwen3TTSModule(str(tiny_dir), speakers=["alice", "bob"])
        if trainer is not None:
            module.trainer = trainer
        module._remember_speakers(SimpleNamespace(speaker_index=torch.tensor([1]), speaker_embedding=table[[1]]))
        assert torch.equal(module.speaker_embeddings[1], table[1]) and module.speaker_embeddings[0].abs().sum() == 0
