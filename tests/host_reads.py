"""Count what a training step reads back from the device, on CPU (test infrastructure).

On a GPU every `.item()`, `float(t)`, `bool(t)`, `int(t)`, Python branch on a tensor and copy to the
host blocks the CPU until the GPU queue drains. On CPU nothing blocks, but the same calls still go
through the same aten ops, which a `TorchDispatchMode` sees:

* ``aten._local_scalar_dense``: the op behind every tensor -> Python number conversion;
* ``aten._to_copy`` / ``aten.copy_`` to the CPU from a tensor that would live on the device: not
  detectable on CPU (the tensor is there already, `.cpu()` returns it without an op), so the
  Python-level calls `.cpu()`, `.tolist()`, `.numpy()` are counted by a `TorchFunctionMode` instead;
* ``aten.nonzero`` and boolean-mask indexing: their output size depends on the data, so on CUDA
  they read a count back too. Recorded separately (`shape_reads`): the loss's target selection uses
  them by design (documented in docs/architecture.md).

* ``torch.distributed.barrier``: NCCL's blocks the CPU until the GPU has caught up (Lightning's
  `Strategy.reduce` and ``self.log(..., sync_dist=True)`` call it before each all-reduce); seen by
  a profile hook (`sys.setprofile`) on calls into it, counted in `syncs` too.

`HostReads` is a Lightning callback: it records from ``on_train_batch_start`` of step k to the
``on_train_batch_start`` of step k+1 (or ``on_train_end``), which covers the forward, backward,
gradient clipping, optimizer and scheduler steps and Lightning's logging of step k. The data
loader runs in worker processes in the tests, so the collate (host work on host tensors) is outside.
"""

from __future__ import annotations

import sys
import traceback
from collections import Counter
from collections.abc import Callable

import lightning as L
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
SCALAR_READS = {aten._local_scalar_dense.default}
SHAPE_READS = {aten.nonzero.default, aten.masked_select.default, aten.unique_consecutive.default}
HOST_COPIES = {torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.numpy}


class _Dispatch(TorchDispatchMode):
    def __init__(self, sink: _Step) -> None:
        super().__init__()
        self.sink = sink

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SCALAR_READS and id(args[0]) in self.sink.host_tensors():
            pass
        elif func in SCALAR_READS:
            self.sink.scalar_reads += 1
            self.sink.sites[_site()] += 1
        elif func in SHAPE_READS or (
            func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default)
            and any(i is not None and i.dtype == torch.bool for i in args[1])
        ):
            self.sink.shape_reads += 1
        return func(*args, **(kwargs or {}))


class _Function(TorchFunctionMode):
    def __init__(self, sink: _Step) -> None:
        super().__init__()
        self.sink = sink

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_COPIES and id(args[0]) not in self.sink.host_tensors():
            self.sink.host_copies[func.__name__] += 1
            self.sink.sites[_site()] += 1
        return func(*args, **(kwargs or {}))


def _site() -> str:
    """The innermost caller outside torch and this file: where the read was asked for."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in frame.filename and not frame.filename.endswith("host_reads.py"):
            return f"{frame.filename.split('site-packages/')[-1]}:{frame.lineno} {frame.name}"
    return "?"


class _Step:
    def __init__(self, step: int, host_tensors: Callable[[], set[int]], padded: bool) -> None:
        self.step = step  # the optimizer step this batch makes (1-based: Lightning's logging count)
        self.padded = padded  # whether the step's batch pads an example (the collate's TalkerBatch.padded)
        self.host_tensors = host_tensors  # ids of tensors that stay on the host on a GPU too
        self.sites: Counter[str] = Counter()  # where the scalar reads and copies come from
        self.scalar_reads = 0
        self.shape_reads = 0
        self.host_copies: Counter[str] = Counter()
        self.barriers = 0

    @property
    def syncs(self) -> int:
        return self.scalar_reads + sum(self.host_copies.values()) + self.barriers

    def __repr__(self) -> str:
        return (
            f"step {self.step} ({'padded' if self.padded else 'unpadded'}): {self.scalar_reads} scalar reads, "
            f"{dict(self.host_copies)} copies, "
            f"{self.barriers} barriers, {self.shape_reads} shape reads, from {dict(self.sites)}"
        )


class HostReads(L.Callback):
    """Per training step, the host reads it makes (``steps``, a list of records with ``step``,
    ``scalar_reads``, ``host_copies``, ``shape_reads``, ``syncs``)."""

    def __init__(self) -> None:
        self.steps: list[_Step] = []
        self._modes: tuple[_Function, _Dispatch] | None = None

    def _close(self) -> None:
        sys.setprofile(None)
        if self._modes is not None:
            function, dispatch = self._modes
            dispatch.__exit__(None, None, None)
            function.__exit__(None, None, None)
            self._modes = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._close()

        # torch's optimizers keep their step counts on the host (unless fused or capturable, where
        # they are never read back): reading those is no device sync. Nor is the FSDP strategies'
        # read of their agreement on signals queued at the previous batch's start, from pinned host
        # memory (tts_lightning/distributed/scheduler_signals.py); the first batch's, queued in the
        # same step, is one.
        agreement = getattr(trainer.strategy, "_signals_pending", None)
        held = agreement.host if agreement is not None else None  # alive while its id is compared

        def steps() -> set[int]:
            carried = {id(held)} if held is not None else set()
            return carried | {id(s["step"]) for o in trainer.optimizers for s in o.state.values() if "step" in s}

        record = _Step(trainer.global_step + 1, steps, batch.padded)
        self.steps.append(record)
        self._modes = (_Function(record), _Dispatch(record))
        self._modes[0].__enter__()
        self._modes[1].__enter__()

        def profile(frame, event, arg) -> None:
            code = frame.f_code
            if event == "call" and code.co_name == "barrier" and code.co_filename.endswith("distributed_c10d.py"):
                record.barriers += 1
                record.sites[_site()] += 1

        sys.setprofile(profile)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._close()  # validation reads its epoch results back by design

    def on_train_end(self, trainer, pl_module) -> None:
        self._close()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._close()
