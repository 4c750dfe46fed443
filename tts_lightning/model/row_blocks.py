"""`RowBlockEmbedding`: the talker's text embedding split into row blocks, each its own FSDP unit.

The text embedding (151936 x 2048, 311M parameters in the released models) is far larger than any
other unit. As one FSDP unit its backward holds the gathered weight, the embedding's dense gradient
and FSDP's flat gradient made from it at once (~3.7 GB in fp32); split into ``k`` row blocks, each
block (an `nn.Embedding`, so FSDP1's class auto-wrap and FSDP2's ``layer_classes`` make it a unit)
holds 1/k of that. The forward is bit-identical to `nn.Embedding`'s: each position takes exactly
one block's row (the other blocks' values are discarded by ``torch.where``), and each block's
gradient is the embedding gradient of its rows (the discarded positions add exact zeros).

Our checkpoints keep the block keys (``...text_embedding.blocks.{i}.weight``); everything that
reads weights back in the official layout joins them (`join_blocks`, `official_layout`), and a
state dict in the official layout is split when loaded into this module.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import cast

import torch
from torch import Tensor, nn

from tts_lightning.errors import ConfigError

# 8 blocks: each 1/8 of the 311M-parameter text embedding (39M parameters), about one 1.7B talker
# decoder layer or three 0.6B ones, so no unit stands far above the layers; more blocks only add
# FSDP units (and collectives) per step.
DEFAULT_TEXT_EMBEDDING_BLOCKS = 8
TEXT_EMBEDDING = "talker.model.text_embedding"
# A block's parameter name, under any prefix ("model." in checkpoints, peft's "base_model.model.").
_BLOCK_KEY = re.compile(r"^(?P<base>(?:.*\.)?talker\.model\.text_embedding)\.blocks\.(?P<index>\d+)\.weight$")


def check_blocks(blocks: int, rows: int) -> None:
    if not isinstance(blocks, int) or not 1 <= blocks <= rows:
        raise ConfigError(
            f"model.text_embedding_blocks must be between 1 and the text vocabulary ({rows}), got {blocks}"
        )


class EmbeddingRowBlock(nn.Embedding):
    """One row block of a `RowBlockEmbedding` (its own class, so that FSDP2 can name it)."""

    def forward(self, input: Tensor, anchor: Tensor | None = None) -> Tensor:
        # ``anchor`` (a zero scalar requiring grad, see `RowBlockEmbedding.anchor_backward`): adding
        # it leaves every value as it is (x + 0 == x) and gives the unit an input with a gradient.
        rows = super().forward(input)
        return rows if anchor is None else rows + anchor


class RowBlockEmbedding(nn.Module):
    """An `nn.Embedding(num_embeddings, embedding_dim)` stored as ``blocks`` row blocks of (almost)
    equal size, the first ones one row larger when the rows do not divide evenly."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, blocks: int, *, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        check_blocks(blocks, num_embeddings)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.rows = [len(r) for r in torch.arange(num_embeddings).tensor_split(blocks)]
        self.starts = [sum(self.rows[:i]) for i in range(blocks)]
        self.blocks = nn.ModuleList(EmbeddingRowBlock(n, embedding_dim, device=device) for n in self.rows)
        self.register_load_state_dict_pre_hook(_split_official_weight)
        # Set by FSDP2 (`tts_lightning.distributed.fsdp2.apply_fully_shard`): a unit runs its
        # post-backward (reduce-scatter, free the gathered weight and full gradient) when the
        # gradient of a forward input arrives, else only at the end of backward. Token ids have no
        # gradient, so without an anchor every block stayed gathered, with its full gradient, until
        # the whole backward was done (2.5 GB per rank at the 0.6B size).
        self.anchor_backward = False

    def forward(self, ids: Tensor) -> Tensor:
        out: Tensor | None = None
        anchor = None
        if self.anchor_backward and torch.is_grad_enabled() and self.blocks[0].weight.requires_grad:
            anchor = torch.zeros((), device=ids.device, requires_grad=True)
        # Every block runs (a FSDP unit gathers in its forward, the same on every rank), on ids
        # clamped into its rows; only the rows of the ids it holds are kept. No host sync.
        for block, start, n in zip(self.blocks, self.starts, self.rows):
            clamped = (ids - start).clamp(0, n - 1)
            rows = block(clamped) if anchor is None else block(clamped, anchor)
            if out is None:
                out = rows
            else:
                out = torch.where(((ids >= start) & (ids < start + n)).unsqueeze(-1), rows, out)
        assert out is not None
        return out

    def bounds(self) -> list[tuple[int, int]]:
        return [(s, s + n) for s, n in zip(self.starts, self.rows)]


def _split_official_weight(module: nn.Module, state_dict: dict, prefix: str, *args: object) -> None:
    """A state dict in the official layout (``<prefix>weight``) loads into the blocks."""
    weight = state_dict.pop(f"{prefix}weight", None)
    if weight is None or not isinstance(module, RowBlockEmbedding):
        return
    for i, (start, stop) in enumerate(module.bounds()):
        state_dict[f"{prefix}blocks.{i}.weight"] = weight[start:stop]


def split_text_embedding(model: nn.Module, blocks: int) -> RowBlockEmbedding:
    """Replace ``model.talker.model.text_embedding`` (an `nn.Embedding`, on any device: meta for
    `tts_lightning.model.loading`) by a `RowBlockEmbedding` holding the same values."""
    talker_model = model.get_submodule("talker.model")
    old = talker_model.text_embedding
    if not isinstance(old, nn.Embedding) or old.padding_idx is not None or old.max_norm is not None:
        raise TypeError(f"{TEXT_EMBEDDING} is not a plain nn.Embedding: {old!r}")
    new = RowBlockEmbedding(old.num_embeddings, old.embedding_dim, blocks, device=old.weight.device)
    new.blocks.requires_grad_(old.weight.requires_grad)
    if not old.weight.is_meta:
        with torch.no_grad():
            for block, (start, stop) in zip(new.blocks, new.bounds()):
                cast(nn.Embedding, block).weight.copy_(old.weight[start:stop])
        new.blocks.to(old.weight.dtype)
    talker_model.text_embedding = new
    return new


def row_slices(model: nn.Module) -> dict[str, tuple[str, int, int]]:
    """``{block parameter name: (official parameter name, first row, end row)}`` of the row-block
    embeddings in ``model`` (names as ``model.named_parameters`` gives them)."""
    slices = {}
    for name, module in model.named_modules():
        if isinstance(module, RowBlockEmbedding):
            prefix = f"{name}." if name else ""
            for i, (start, stop) in enumerate(module.bounds()):
                slices[f"{prefix}blocks.{i}.weight"] = (f"{prefix}weight", start, stop)
    return slices


def official_key(key: str) -> str:
    """The official layout's name of a parameter: a block's ``weight`` names the whole embedding."""
    match = _BLOCK_KEY.match(key)
    return key if match is None else f"{match['base']}.weight"


def block_groups(keys: Iterable[str]) -> dict[str, list[str]]:
    """``{official key: its block keys in row order}`` for the block keys among ``keys``."""
    groups: dict[str, list[tuple[int, str]]] = {}
    for key in keys:
        match = _BLOCK_KEY.match(key)
        if match is not None:
            groups.setdefault(f"{match['base']}.weight", []).append((int(match["index"]), key))
    return {k: [key for _, key in sorted(v)] for k, v in groups.items()}


def official_layout(keys: Iterable[str]) -> list[str]:
    """``keys`` with each embedding's block keys replaced by its official key (at the first block)."""
    out: dict[str, None] = {}  # ordered, each name once
    for key in keys:
        out.setdefault(official_key(key))
    return list(out)


def join_blocks(values: Mapping[str, Tensor], block_keys: list[str]) -> Tensor:
    """The official weight from its blocks' values (one copy, in the blocks' dtype)."""
    return torch.cat([values[k] for k in block_keys], dim=0)


def official_state(values: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``values`` (a state dict) with each embedding's blocks joined under its official key."""
    groups = block_groups(values)
    joined = {key: join_blocks(values, groups[key]) for key in groups}
    return {key: joined[key] if key in joined else values[key] for key in official_layout(values)}
