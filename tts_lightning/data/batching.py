"""Length-bucketed batches with a padding-aware frame cap, split evenly across ranks, resumable mid-epoch;
and the two shims that hand them to a DataLoader under Lightning (`BatchSamplerView`, `ResumableDataLoader`)."""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Sampler

logger = logging.getLogger(__name__)


class LengthBucketBatchSampler(Sampler[list[int]]):
    """Yield lists of dataset indices, grouping clips of similar length to limit padding.

    Per epoch (deterministic given `seed + epoch`, identical on every rank):
      1. shuffle all indices (if `shuffle`), cut them into chunks of about
         `bucket_size_multiplier` batches and sort each chunk by length;
      2. pack each sorted chunk greedily so that `len(batch) * max(length in batch) <= max_frames`
         (the padded size) and `len(batch) <= batch_size`;
      3. shuffle the batch order (if `shuffle`) and deal batches round-robin to the ranks.

    A clip longer than `max_frames` alone still forms a batch of one (a warning is logged once
    at construction): dropping it silently would lose data the user validated, and the
    validation step's `max_duration` is the place to bound clip length.

    Every rank gets the same number of batches, which DDP/FSDP need to avoid a hang. When the
    batch count does not divide evenly, `drop_last=False` repeats batches from the start of the
    epoch's list (so a few clips are seen twice that epoch, only to equalise);
    `drop_last=True` drops the tail batches instead (those clips are skipped that epoch).

    `state_dict()` records the epoch and how many batches this sampler has handed out in it;
    after `load_state_dict()`, the next `__iter__` skips that many once. Note that a DataLoader
    with workers pulls batches ahead of training (up to num_workers * prefetch_factor), so the
    caller may prefer to save the trainer's own batch counter as "consumed".
    """

    def __init__(
        self,
        lengths: Sequence[int],
        *,
        max_frames: int | None = None,
        batch_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
        bucket_size_multiplier: int = 100,
    ) -> None:
        if max_frames is None and batch_size is None:
            raise ValueError("LengthBucketBatchSampler needs max_frames, batch_size, or both")
        if max_frames is not None and max_frames <= 0:
            raise ValueError(f"max_frames must be positive, got {max_frames}")
        if batch_size is not None and batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if bucket_size_multiplier <= 0:
            raise ValueError(f"bucket_size_multiplier must be positive, got {bucket_size_multiplier}")
        self.lengths = [int(n) for n in lengths]
        if not self.lengths:
            raise ValueError("LengthBucketBatchSampler got an empty lengths list (no clips to batch)")
        bad = [i for i, n in enumerate(self.lengths) if n <= 0]
        if bad:
            raise ValueError(f"lengths must be positive frame counts; items {bad[:5]} are not")

        if num_replicas is None:
            num_replicas = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if num_replicas <= 0 or not 0 <= rank < num_replicas:
            raise ValueError(f"invalid rank {rank} for num_replicas {num_replicas}")

        self.max_frames = max_frames
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.num_replicas = num_replicas
        self.rank = rank
        self.drop_last = drop_last
        self.bucket_size_multiplier = bucket_size_multiplier

        self.epoch = 0
        self._consumed = 0  # batches yielded so far in self.epoch
        self._resume_from = 0  # batches to skip on the next __iter__ (set by load_state_dict)
        self._cache: tuple[int, list[list[int]]] | None = None

        if max_frames is not None:
            over = sum(1 for n in self.lengths if n > max_frames)
            if over:
                logger.warning(
                    "%d clip(s) are longer than max_frames=%d (longest %d); each will form a batch of one",
                    over,
                    max_frames,
                    max(self.lengths),
                )

    # -- batch construction ---------------------------------------------------------------

    def _chunk_size(self) -> int:
        per_batch = self.batch_size or len(self.lengths)
        if self.max_frames is not None:
            mean_len = sum(self.lengths) / len(self.lengths)
            per_batch = min(per_batch, max(1, int(self.max_frames // mean_len)))
        return max(1, per_batch * self.bucket_size_multiplier)

    def _fits(self, count: int, longest: int) -> bool:
        if self.batch_size is not None and count > self.batch_size:
            return False
        return self.max_frames is None or count * longest <= self.max_frames

    def _pack(self, sorted_indices: list[int]) -> list[list[int]]:
        batches: list[list[int]] = []
        current: list[int] = []
        longest = 0
        for idx in sorted_indices:
            n = self.lengths[idx]
            if current and not self._fits(len(current) + 1, max(longest, n)):
                batches.append(current)
                current, longest = [], 0
            current.append(idx)
            longest = max(longest, n)
        if current:
            batches.append(current)
        return batches

    def _global_batches(self, epoch: int) -> list[list[int]]:
        """All batches of an epoch, before splitting across ranks (same on every rank)."""
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        n = len(self.lengths)
        order = torch.randperm(n, generator=g).tolist() if self.shuffle else list(range(n))
        chunk = self._chunk_size()
        batches: list[list[int]] = []
        for start in range(0, n, chunk):
            # Stable sort: equal lengths keep the shuffled order.
            part = sorted(order[start : start + chunk], key=self.lengths.__getitem__)
            batches.extend(self._pack(part))
        if self.shuffle:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]
        return batches

    def _rank_batches(self, epoch: int) -> list[list[int]]:
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        batches = self._global_batches(epoch)
        total = len(batches)
        if self.drop_last:
            per_rank = total // self.num_replicas
            batches = batches[: per_rank * self.num_replicas]
        else:
            per_rank = math.ceil(total / self.num_replicas)
            pad = per_rank * self.num_replicas - total
            batches = batches + [batches[i % total] for i in range(pad)]
        mine = batches[self.rank :: self.num_replicas]
        self._cache = (epoch, mine)
        return mine

    # -- Sampler protocol ------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's order. Setting the epoch already loaded from a checkpoint keeps the resume point."""
        if epoch != self.epoch:
            self.epoch = epoch
            self._consumed = 0
            self._resume_from = 0

    def __len__(self) -> int:
        """Batches this rank yields in a full pass of the current epoch."""
        return len(self._rank_batches(self.epoch))

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._rank_batches(self.epoch)
        start, self._resume_from = self._resume_from, 0
        self._consumed = start
        for batch in batches[start:]:
            self._consumed += 1
            yield list(batch)

    # -- resume ----------------------------------------------------------------------------

    def plan_digest(self, epoch: int) -> str:
        """A digest of the epoch's batches over all ranks (the same on every rank): a saved batch count
        resumes the same batches only under the same plan."""
        return hashlib.sha256(json.dumps(self._global_batches(epoch)).encode()).hexdigest()[:16]

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "consumed": self._consumed,
            "seed": self.seed,
            "num_replicas": self.num_replicas,
            "plan": self.plan_digest(self.epoch),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        epoch, consumed = int(state["epoch"]), int(state["consumed"])
        if epoch < 0 or consumed < 0:
            raise ValueError(f"invalid sampler state {state}: epoch and consumed must be >= 0")
        self.epoch = epoch
        # Every rank takes the same decision from the same state; rank 0 says it, once.
        warn = logger.warning if self.rank == 0 else logger.debug
        if (
            state.get("seed", self.seed) != self.seed
            or state.get("num_replicas", self.num_replicas) != self.num_replicas
        ):
            # A different seed or world size gives different batches, so the count is meaningless.
            warn(
                "sampler state was saved with seed=%s num_replicas=%s, now seed=%s num_replicas=%s; "
                "restarting epoch %d from its first batch",
                state.get("seed"),
                state.get("num_replicas"),
                self.seed,
                self.num_replicas,
                epoch,
            )
            consumed = 0
        elif "plan" in state and state["plan"] != self.plan_digest(epoch):  # older states have no plan
            # The clips, their lengths (ICL: with their references) or the batch limits changed.
            warn(
                "epoch %d's batches differ from those the checkpoint counted (the training clips, their "
                "lengths or data.max_frames_per_batch / batch_size changed); restarting it from its first batch",
                epoch,
            )
            consumed = 0
        consumed = min(consumed, len(self))
        self._consumed = consumed
        self._resume_from = consumed


class BatchSamplerView(Sampler[list[int]]):
    """Hands a `LengthBucketBatchSampler` to a DataLoader. Lightning calls ``set_epoch`` on
    ``dataloader.batch_sampler.sampler`` at every epoch start, which is the bucket sampler here."""

    def __init__(self, sampler: LengthBucketBatchSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


class ResumableDataLoader(DataLoader):
    """A DataLoader that tells Lightning it can resume mid-epoch. The position itself is saved by
    `SpeakerClipsDataModule.state_dict` (the train sampler's epoch and consumed batches), so these
    hold nothing; without them Lightning warns that a mid-epoch resume is unreliable."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass
