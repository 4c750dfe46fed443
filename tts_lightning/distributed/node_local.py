"""Sharded checkpoints that each node can resume from on its own disk.

A run of several nodes whose checkpoint folder is a node-local path (the same path on machines with
their own disks) leaves on each node only the shard files its own ranks wrote. With
torch.distributed.checkpoint's defaults that folder cannot be read back there: the index
(``.metadata``) and Lightning's ``meta.pt`` are written by global rank 0 alone, and a tensor that
every rank holds (buffers, the speaker table, optimizer step counts, settings) is written by one rank
of the whole run. Here:

- `NodeLocalSavePlanner` removes the duplicates of such a tensor within each node only, so every
  node writes one copy of it;
- `NodeLocalWriter` (global rank 0, when the save ends) makes one index per node, in which each
  tensor is found in a file that node's ranks wrote; `AtomicCheckpoints` hands each node its index
  and ``meta.pt``, and a node that does not see rank 0's files (node-local storage) writes them.

Each rank then resumes from its own node's folder, with the same number of ranks per node. On
shared storage nothing changes but the few duplicated small tensors: every node sees rank 0's
index. Reading the whole checkpoint (export, another world size) needs every node's shard files in
one folder: their names differ by rank, so copying the nodes' folders together gives it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult


class NodeLocalSavePlanner(DefaultSavePlanner):
    """DCP's planner, with each node writing one copy of what several ranks hold.

    The index (metadata) is DCP's own, from the plans with the duplicates removed over all ranks;
    the plans the ranks write are those with the duplicates removed within each node only.
    ``nodes``: the node of every global rank."""

    def __init__(self, nodes: list[int]) -> None:
        super().__init__()
        self.nodes = list(nodes)

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        global_plans, metadata = super()._create_global_plan(all_plans)
        # The index hints DCP gave each item, by tensor and offset (a duplicate gets its original's).
        hints = {(item.index.fqn, item.index.offset): item.index for plan in global_plans for item in plan.items}
        plans = list(global_plans)
        for node in sorted(set(self.nodes)):
            ranks = [rank for rank, n in enumerate(self.nodes) if n == node]
            own = dedup_save_plans([all_plans[r] for r in ranks], self.dedup_save_to_lowest_rank)
            for rank, plan in zip(ranks, own):
                items = [dataclasses.replace(i, index=hints[(i.index.fqn, i.index.offset)]) for i in plan.items]
                plans[rank] = dataclasses.replace(global_plans[rank], items=items)
        return plans, metadata


class NodeLocalWriter(FileSystemWriter):
    """DCP's file writer, whose index on global rank 0 points every tensor at a file of rank 0's node,
    and which keeps the other nodes' indexes (`node_indexes`) for `AtomicCheckpoints` to hand out."""

    def __init__(self, path: str | Path, nodes: list[int]) -> None:
        super().__init__(path)
        self.nodes = list(nodes)
        self.node_indexes: dict[int, Metadata] = {}

    def _own_node_last(self, results: list[list[WriteResult]], node: int) -> list[list[WriteResult]]:
        """The ranks' write results, ``node``'s last: the index keeps the last location of a tensor."""
        return [r for rank, r in enumerate(results) if self.nodes[rank] != node] + [
            r for rank, r in enumerate(results) if self.nodes[rank] == node
        ]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        own = self.nodes[0]  # the coordinator is global rank 0
        super().finish(metadata, self._own_node_last(results, own))  # writes .metadata, sets its fields
        for node in sorted(set(self.nodes) - {own}):
            located = {wr.index: wr.storage_data for rank in self._own_node_last(results, node) for wr in rank}
            self.node_indexes[node] = dataclasses.replace(metadata, storage_data=located)
