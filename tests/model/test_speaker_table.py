"""The `speaker_embeddings` buffer that checkpoints and export carry is complete and identical on
every rank, even when each rank has seen only some of the speakers."""

import os
import socket
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tts_lightning import Qwen3TTSModule


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, port, tiny_dir, table, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        module = Qwen3TTSModule(tiny_dir, speakers=["alice", "bob", "carol"])
        # Rank 0 sees alice then alice again; rank 1 sees bob and carol, then carol.
        seen = [[0], [0]] if rank == 0 else [[1, 2], [2]]
        for indices in seen:
            batch = SimpleNamespace(speaker_index=torch.tensor(indices), speaker_embedding=table[indices])
            module._remember_speakers(batch)
        torch.save(module.speaker_embeddings, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_every_rank_holds_every_speaker(tiny_dir, tmp_path):
    table = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)) * 3
    mp.spawn(_worker, args=(_free_port(), str(tiny_dir), table, str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        assert torch.equal(torch.load(tmp_path / f"rank{rank}.pt"), table)  # exact, not averaged


def test_single_process_fills_rows_as_seen(tiny_dir):
    module = Qwen3TTSModule(str(tiny_dir), speakers=["alice", "bob"])
    table = torch.randn(2, 64)
    module._remember_speakers(SimpleNamespace(speaker_index=torch.tensor([1]), speaker_embedding=table[[1]]))
    assert torch.equal(module.speaker_embeddings[1], table[1]) and module.speaker_embeddings[0].abs().sum() == 0
