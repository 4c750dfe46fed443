"""All-reduces a training step issues without stopping the host.

Lightning's `Strategy.reduce` (and so ``self.log(..., sync_dist=True)`` at every step) calls
``torch.distributed.barrier`` before its all-reduce, and NCCL's barrier blocks the CPU until the
GPU has caught up: the queue of kernels drains mid-step. `torch.distributed.all_reduce` alone is
queued on the device (NCCL) and returns; on CPU (gloo) it computes there and then, as everything does."""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist


def all_reduce_in_step(tensor: torch.Tensor, op: Literal["sum", "max", "mean"], world_size: int) -> torch.Tensor:
    """``tensor`` reduced over the default process group (in place for sum and max), or itself when
    the run has one process (``world_size``: the Trainer's; a one-device run after a multi-GPU one
    in the same processes must not reduce over the group Lightning keeps)."""
    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return tensor
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)  # gloo has no AVG
    return tensor.div_(dist.get_world_size()) if op == "mean" else tensor
