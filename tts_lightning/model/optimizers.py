"""The optimizers `Qwen3TTSModule` trains with (``model.optimizer``), from the most memory to the least.

- ``adamw``: torch AdamW on fp32 weights (fused on GPUs): 4 bytes of weights, 4 of gradient and
  8 of moments per trained parameter. The default.
- ``adamw8bit`` / ``adamw4bit``: torchao's AdamW8bit / AdamW4bit: the same fp32 weights and
  gradients, the two moments quantized block-wise (2 bytes per parameter plus one fp32 scale per
  256-value block; 1 byte plus one per 128). Pieces under 4096 values keep fp32 moments (torchao).
  adamw4bit trains slower (`CAVEATS`): its 4-bit first moment is rounded to the nearest of 16 levels
  of its block's largest value at every step, and the rounding errors accumulate (a relative error
  of 0.67 by step 60 on the tiny demo); its 4-bit second moment alone costs little
  (benchmarks/optimizer_4bit_moments.py, docs/benchmarks.md).
- ``bf16_sr``: bf16 weights and gradients, bf16 moments (torchao's AdamW, as its README's
  ``bf16_stochastic_round=True`` example), the update computed in fp32 and rounded stochastically.
- ``bf16_sr_adamw8bit``: bf16 weights and gradients with 8-bit moments: the least memory.

Why stochastic rounding: bf16 keeps 8 significant bits, so a weight w moves only when its update
exceeds half a unit in the last place, about w/256. At fine-tuning rates (lr 2e-6, updates of about
lr per step) nearly every update is smaller and round-to-nearest drops it: the weights never move.
Rounding up with probability (remainder / ulp) keeps each update's expected value. bf16 weights with
any other optimizer are refused (`check_optimizer`).

torchao compiles its step per parameter shape (``torch.compile(fullgraph=True)``): on GPUs that is
its fast path; on the CPU, where compiling every shape costs minutes and the step is not the cost,
the same torchao function (`single_param_adam`) runs eagerly (the one branch: `_EagerOnCPU._step`).
The math, the state and its initialisation are torchao's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, get_args

import torch
from torch import Tensor

from tts_lightning.errors import ConfigError

OptimizerName = Literal["adamw", "adamw8bit", "adamw4bit", "bf16_sr", "bf16_sr_adamw8bit"]
OPTIMIZERS: tuple[str, ...] = get_args(OptimizerName)
# What an option costs in quality, measured (docs/benchmarks.md), for `tts-lightning plan` to say beside it.
CAVEATS = {"adamw4bit": "trains slower than the others (4-bit first moment): prefer adamw8bit"}


def weights_dtype(name: str) -> torch.dtype:
    """The dtype of the trained (and frozen) weights under optimizer ``name``."""
    return torch.bfloat16 if name.startswith("bf16_sr") else torch.float32


def quantized_moments(name: str) -> int | None:
    """Bits per moment value (8 or 4) of a quantized-state optimizer, else None."""
    return 8 if name.endswith("8bit") else 4 if name.endswith("4bit") else None


def check_optimizer(name: str, precision: str | None) -> None:
    """Refuse the combinations that silently lose updates, naming the settings and what to do."""
    if name not in OPTIMIZERS:
        raise ConfigError(f"model.optimizer {name!r} is not one of {list(OPTIMIZERS)}")
    if precision is None:
        return
    precision = str(precision)
    if name.startswith("bf16_sr") and precision != "bf16-mixed":
        raise ConfigError(
            f"model.optimizer {name} keeps bf16 weights and computes in bf16: set trainer.precision "
            f"bf16-mixed (fp32 reductions), not {precision!r}"
        )
    if not name.startswith("bf16_sr") and precision in ("bf16-true", "16-true", "bf16", "16", "half"):
        raise ConfigError(
            f"trainer.precision {precision} stores the weights in 16 bits, where round-to-nearest drops updates "
            f"under 1/256 of a weight (all of them at fine-tuning rates): use bf16-mixed (fp32 weights), or "
            f"model.optimizer bf16_sr / bf16_sr_adamw8bit (bf16 weights, stochastic rounding)"
        )


def build_optimizer(
    name: str, params: Sequence[Tensor] | Sequence[dict[str, Any]], lr: float, weight_decay: float
) -> torch.optim.Optimizer:
    """The optimizer ``name`` over ``params`` (the trainable parameters, local shards under FSDP, or
    parameter groups of them)."""
    tensors: list[Tensor] = []
    for item in params:
        tensors.extend(item["params"] if isinstance(item, dict) else [item])
    if name == "adamw":
        # The fused kernel on GPUs: one launch per step instead of several per parameter. With
        # cpu_offload the (sharded) parameters live on the CPU, where the default is right.
        fused = bool(tensors) and all(p.is_cuda for p in tensors)
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)
    from torchao.optim import AdamW4bit, AdamW8bit, _AdamW

    bf16 = name.startswith("bf16_sr")
    if bf16 and any(p.dtype != torch.bfloat16 for p in tensors):
        raise ConfigError(f"model.optimizer {name} trains bf16 weights, but some trainable weights are not bf16")
    base: Any = {8: AdamW8bit, 4: AdamW4bit, None: _AdamW}[quantized_moments(name)]
    cls = type(f"TorchaoAdamW_{name}", (_EagerOnCPU, base), {})
    return cls(params, lr=lr, weight_decay=weight_decay, bf16_stochastic_round=bf16)


def holds_rank_local_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` keeps quantized moments: block-quantized pieces of each rank's local shard,
    which checkpoints save per rank (`tts_lightning.distributed.rank_local_state`)."""
    return isinstance(optimizer, _EagerOnCPU) and optimizer.block_size != float("inf")


class _EagerOnCPU(torch.optim.Optimizer):
    """torchao's ``_AdamBase.step`` with the compile only on accelerators (see the module docstring)."""

    block_size: float
    bf16_stochastic_round: bool
    is_adamw: bool

    @torch.no_grad()
    def step(self, closure=None):
        if not self.bf16_stochastic_round:
            return self._step(closure)
        # Stochastic rounding draws random bits: from a generator seeded by the step and the rank, so
        # that a resumed run rounds as the uninterrupted one did (the global generator's state is
        # not in checkpoints).
        devices = sorted({p.device.index or 0 for g in self.param_groups for p in g["params"] if p.is_cuda})
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self._rounding_seed())
            return self._step(closure)

    def _rounding_seed(self) -> int:
        steps = [int(s["step"]) for s in self.state.values() if "step" in s]
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return (max(steps, default=0) + 1) * 65_537 + rank

    def _step(self, closure=None):
        from torchao.optim.adam import single_param_adam

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        update = single_param_adam
        if any(p.device.type != "cpu" for g in self.param_groups for p in g["params"]):
            # GPU only (the same function, compiled): run by benchmarks/gpu_check.py (config_1.7b_1x24gb).
            update = torch.compile(single_param_adam, fullgraph=True, dynamic=False)
        # One compile per parameter shape (torchao's reasoning): the cache limit would stop at 8.
        with torch._dynamo.utils.disable_cache_limit():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._update(update, group, p)
        return loss

    def _update(self, update: Any, group: dict[str, Any], p: Tensor) -> None:
        state = self.state[p]
        if len(state) == 0:  # as torchao initialises it
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = self._new_buffer(p, True)  # type: ignore[attr-defined]
            state["exp_avg_sq"] = self._new_buffer(p, False)  # type: ignore[attr-defined]
        state["step"] += 1
        # The update is element-wise: it runs on this rank's local tensors (FSDP2's DTensors
        # unwrapped; DTensor cannot propagate a bf16 8-bit state's lerp).
        update(
            local_tensor(p.detach()),
            local_tensor(p.grad),
            state["step"],
            local_tensor(state["exp_avg"]),
            local_tensor(state["exp_avg_sq"]),
            None,
            group["lr"],
            group["betas"][0],
            group["betas"][1],
            group["weight_decay"],
            group["eps"],
            self.is_adamw,
            self.bf16_stochastic_round and p.dtype is torch.bfloat16,
        )


def local_tensor(value: Any) -> Any:
    """This rank's piece of ``value`` where it is a DTensor (FSDP2's sharded tensors), else ``value``."""
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value
