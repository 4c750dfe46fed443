"""Activation checkpointing of the code predictor's decoder layers, and of its heads, by blocks of rows.

The code predictor runs each frame as its own 16-position sequence: its batch has one row per frame
of the micro-batch (2000 rows at 2000 frames), and the rows never meet (attention stays within a
row). Checkpointing a layer as a whole recomputes it for every row at once in backward, and all the
tensors that layer saves are alive together then: at 0.6B and 2000 frames, 2.1 GiB of the step's
3.6 GiB peak of activations. Checkpointing each block of `PREDICTOR_ROWS` rows separately gives the
same values and gradients (each row is computed alone either way) with at most one block's
tensors alive while it is recomputed. The memory planner reads `PREDICTOR_ROWS`
(`tts_lightning.distributed.memory.activations`); benchmarks/activation_memory.py measures it.

Both strategies use it: FSDP1 on Lightning's ``CheckpointWrapper`` around each predictor layer (the
wrapper is called once per block), FSDP2 instead of composable checkpointing on the layer itself.
The layer stays the FSDP unit called once per step: only the checkpointed call is repeated inside
it, so gathers, hooks and parameter names are unchanged.

The heads and their cross-entropy (`tts_lightning.model.loss.predictor_losses`) go the same way,
without a strategy: `checkpointed_by_rows`, blocks of `HEAD_ROWS` frames. The heads are the root
unit's parameters under both strategies: FSDP1 keeps the root gathered from the forward to the
backward; FSDP2 frees it after the forward (its ``reshard_after_forward``) and gathers it again
before the backward reaches the heads (its pre-backward hook on the step's outputs).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from types import MethodType
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "HEAD_ROWS",
    "PREDICTOR_ROWS",
    "checkpoint_by_rows",
    "checkpoint_wrapped_predictor_by_rows",
    "checkpointed_by_rows",
    "is_checkpointed_by_rows",
]

# Rows (frames) per checkpointed block: 8192 positions, large enough to keep a GPU's matmuls
# efficient, small enough that one block's recomputation is a quarter of 2000 frames' (0.6B, 1.7B).
PREDICTOR_ROWS = 512
# Frames per block of the code predictor's heads and cross-entropy (`tts_lightning.model.loss`):
# their logits, 15 heads x 2048 codes per frame in fp32, were the largest activation of a step (0.7
# GiB of 2.0 at 2000 frames, kept until the backward); by blocks, one block's are alive at a time,
# recomputed in backward (the heads are ~2% of a 0.6B forward's work: ~0.5% more per step).
HEAD_ROWS = 512


def checkpoint_by_rows(module: nn.Module, *, checkpointed: bool) -> None:
    """Make ``module``'s forward run once per block of `PREDICTOR_ROWS` rows of its first argument
    (dimension 0), splitting every tensor argument with as many rows, and concatenate the outputs.
    ``checkpointed``: the module's class forward already checkpoints (Lightning's
    ``CheckpointWrapper``); otherwise each block runs under `torch.utils.checkpoint`. A module's
    forward is replaced on the instance (a deep copy keeps it, bound to the copy)."""
    module.forward = MethodType(_wrapped_rows if checkpointed else _checkpointed_rows, module)


def checkpoint_wrapped_predictor_by_rows(model: nn.Module) -> nn.Module:
    """FSDP1: every ``CheckpointWrapper`` (Lightning's activation checkpointing) around a code
    predictor decoder layer of ``model`` is called once per block of rows; returns ``model``."""
    from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSDecoderLayer
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    for sub in model.modules():
        if isinstance(sub, CheckpointWrapper) and isinstance(sub._checkpoint_wrapped_module, Qwen3TTSDecoderLayer):
            checkpoint_by_rows(sub, checkpointed=True)
    return model


def checkpointed_by_rows(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` by blocks of `HEAD_ROWS` rows (dimension 0 of every tensor argument with
    as many rows as the first), each block under `torch.utils.checkpoint` (nothing it computes is
    kept for backward but its outputs), the outputs concatenated; one call without gradients.
    ``function`` must treat rows independently. The random state is replayed in the recomputation
    (checkpoint's default), so a dropout there (a LoRA adapter on a head) draws the same mask."""
    return _by_rows(lambda *a: checkpoint(function, *a, use_reentrant=False), args, {}, HEAD_ROWS)


def is_checkpointed_by_rows(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, MethodType) and forward.__func__ in (_wrapped_rows, _checkpointed_rows)


def _wrapped_rows(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return _by_rows(partial(type(self).forward, self), args, kwargs, PREDICTOR_ROWS)


def _checkpointed_rows(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    forward = partial(type(self).forward, self)
    return _by_rows(lambda *a, **k: checkpoint(forward, *a, use_reentrant=False, **k), args, kwargs, PREDICTOR_ROWS)


def _by_rows(forward: Callable[..., Any], args: tuple, kwargs: dict[str, Any], size: int) -> Any:
    hidden = args[0] if args else kwargs.get("hidden_states")
    rows = hidden.shape[0] if isinstance(hidden, Tensor) else 0
    # One call without gradients (validation, generation) or with a KV cache (generation's steps).
    if rows <= size or not torch.is_grad_enabled() or kwargs.get("past_key_values") is not None:
        return forward(*args, **kwargs)
    starts = range(0, rows, size)

    def block(value: Any, i: int) -> Any:
        if isinstance(value, Tensor) and value.dim() and value.shape[0] == rows:
            return value[starts[i] : starts[i] + size]
        if isinstance(value, tuple):
            return tuple(block(v, i) for v in value)
        return value

    outputs = [forward(*block(args, i), **{k: block(v, i) for k, v in kwargs.items()}) for i in range(len(starts))]
    if isinstance(outputs[0], Tensor):
        return torch.cat(outputs)
    # A layer returns (hidden_states,) or (hidden_states, attention weights): each concatenated.
    return tuple(torch.cat(parts) if isinstance(parts[0], Tensor) else parts[0] for parts in zip(*outputs))
