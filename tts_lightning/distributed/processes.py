"""How each rank's process is set up: its share of the CPU threads and the backends of its process
group. Shared by both FSDP strategies and the Ray launcher."""

from __future__ import annotations

import os

import torch


def split_cpu_threads(num_processes: int) -> None:
    """Lightning sets threads in rank 0 only; ranks sharing the cores must split them
    (``OMP_NUM_THREADS`` wins when set)."""
    threads = max(1, (os.cpu_count() or 1) // max(num_processes, 1))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", threads)))


def choose_backend(device: torch.device, cpu_offload: bool, requested: str | None = None) -> str:
    """The process group's backend for ranks computing on ``device``: ``requested`` when given, gloo on
    CPU, NCCL on GPUs. With ``cpu_offload`` on GPUs also gloo for CPU tensors
    (``"cpu:gloo,cuda:nccl"``): under FSDP2 the offloaded gradients are DTensors on the CPU, and
    gradient clipping all-reduces their norm over the mesh's group, which NCCL refuses ("No backend
    type associated with device type cpu"). Rehearsed on CPU by
    tests/distributed/test_process_group.py (gloo registered for the CUDA device type only stands in
    for NCCL); benchmarks/gpu_check.sh checks it on a GPU when one is lent."""
    if requested:
        return requested
    if device.type == "cuda":
        return "cpu:gloo,cuda:nccl" if cpu_offload else "nccl"
    return "gloo"
