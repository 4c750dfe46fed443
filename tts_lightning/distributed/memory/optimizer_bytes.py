"""Bytes of the model states under each `model.optimizer` (`tts_lightning.model.optimizers`).

Per trained value of a rank's local piece of a parameter:

================== ======= ========= ===========================================================
optimizer          weights gradients moments (exp_avg + exp_avg_sq)
================== ======= ========= ===========================================================
adamw              4       4         8
adamw8bit          4       4         2 + 2 * 4 / 256 (one fp32 scale per 256 values) + 2 KiB per piece
adamw4bit          4       4         1 + 2 * 4 / 128 + 128 B per piece
bf16_sr            2       2         4 (bf16 moments)
bf16_sr_adamw8bit  2       2         as adamw8bit
================== ======= ========= ===========================================================

torchao quantizes a piece only when it has at least 4096 values and divides into whole blocks
(others keep moments in the weights' dtype); the lookup tables (256 fp32 values for 8 bits, 16 for 4
bits) are per moment tensor. Frozen weights are stored as the trained ones (bf16 with the bf16
options). The step counters (one scalar per parameter) are left out, as the AdamW plan leaves them.

The optimizer step also holds fp32 copies of the piece it updates (torchao computes in fp32: the
weight, the gradient and both moments, plus the random bits of stochastic rounding): `STEP_BYTES`
per value of the largest trained piece. These transients are an estimate (compiled on the GPU,
fused kernels may keep fewer).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from tts_lightning.model.optimizers import quantized_moments, weights_dtype

MIN_QUANTIZED = 4096  # torchao quantizes pieces of at least this many values (as bitsandbytes)
BLOCKS = {8: 256, 4: 128}  # values per fp32 scale
QMAP_BYTES = {8: 256 * 4, 4: 16 * 4}
STEP_BYTES = {"adamw": 0, "adamw8bit": 16, "adamw4bit": 16, "bf16_sr": 20, "bf16_sr_adamw8bit": 20}


def value_bytes(optimizer: str) -> int:
    """Bytes of one weight (and of its gradient) under ``optimizer``."""
    return weights_dtype(optimizer).itemsize


def moment_bytes(optimizer: str, local: int) -> int:
    """Bytes of both moments of a local piece of ``local`` values."""
    bits = quantized_moments(optimizer)
    if optimizer == "adamw":
        return 8 * local
    if bits is None or local < MIN_QUANTIZED or local % BLOCKS[bits]:
        return 2 * value_bytes(optimizer) * local  # torchao's zeros_like(piece)
    one = local * bits // 8 + 4 * (local // BLOCKS[bits]) + QMAP_BYTES[bits]
    return 2 * one


def option_states(
    shape: Any,
    optimizer: str,
    shards: int,
    fsdp2: bool,
    is_trainable: Callable[[str], bool],
    grad_numel: int,
    frozen_bytes: int,
) -> tuple[int, int, int, int]:
    """(parameters, gradients, moments, largest trained piece) per GPU under ``optimizer``: each
    parameter's local piece is its dim 0 padded to a multiple of ``shards`` rows (FSDP2) or its
    1/``shards`` share (FSDP1, whose flat shards cut parameters anywhere: an estimate above one GPU).
    Frozen weights take ``frozen_bytes`` each (bf16 with the bf16 options: `Qwen3TTSModule`)."""
    size = value_bytes(optimizer)
    params_b = grads_b = moments_b = largest = 0
    for unit in shape.units:
        rows = unit.rows or (0,) * len(unit.params)
        for (name, numel), dim0 in zip(unit.params, rows, strict=True):
            if fsdp2:
                local = math.ceil(dim0 / shards) * (numel // dim0) if dim0 else 0
            else:
                local = math.ceil(numel / shards)
            if not is_trainable(name):
                params_b += (size if size == 2 else frozen_bytes) * local
            else:
                params_b += size * local
                moments_b += moment_bytes(optimizer, local)
                largest = max(largest, local)
                if fsdp2:
                    grads_b += size * local
    if not fsdp2:  # a flat gradient for every unit with a trainable parameter
        grads_b = size * math.ceil(grad_numel / shards)
    return params_b, grads_b, moments_b, largest
