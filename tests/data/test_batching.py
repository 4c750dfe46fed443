from __future__ import annotations

import logging
import random
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader

from tts_lightning.data.batching import LengthBucketBatchSampler


def _lengths(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(40, 1000) for _ in range(n)]


def _ranks(lengths, world: int = 2, **kw) -> list[LengthBucketBatchSampler]:
    return [LengthBucketBatchSampler(lengths, num_replicas=world, rank=r, **kw) for r in range(world)]


@pytest.mark.parametrize(
    ("n", "kw", "divides"),
    [
        (40, {"batch_size": 5}, True),  # 8 batches over 2 ranks
        (45, {"batch_size": 5}, False),  # 9 batches: one batch repeated to equalise
        (203, {"max_frames": 3000, "bucket_size_multiplier": 4}, None),
        (17, {"max_frames": 2500, "batch_size": 3}, None),
    ],
)
def test_two_ranks_cover_every_clip_once_with_equal_batch_counts(n, kw, divides) -> None:
    lengths = _lengths(n)
    samplers = _ranks(lengths, seed=3, **kw)
    per_rank = [list(s) for s in samplers]
    assert len(per_rank[0]) == len(per_rank[1]) == len(samplers[0]) == len(samplers[1]) > 0

    all_batches = [tuple(b) for rank in per_rank for b in rank]
    distinct = set(all_batches)
    repeats = len(all_batches) - len(distinct)
    assert repeats <= 1  # equalising repeats only: at most world_size - 1 whole batches
    if divides is not None:
        assert repeats == (0 if divides else 1)
    # The distinct batches partition the dataset: every clip exactly once.
    counts = Counter(i for b in distinct for i in b)
    assert sorted(counts) == list(range(n)) and set(counts.values()) == {1}

    for batch in all_batches:
        if "max_frames" in kw:
            assert len(batch) * max(lengths[i] for i in batch) <= kw["max_frames"]
        if "batch_size" in kw:
            assert len(batch) <= kw["batch_size"]


def test_drop_last_drops_the_tail_instead_of_repeating() -> None:
    lengths = _lengths(45)
    per_rank = [list(s) for s in _ranks(lengths, batch_size=5, drop_last=True, seed=1)]
    assert len(per_rank[0]) == len(per_rank[1]) == 4
    seen = Counter(i for rank in per_rank for b in rank for i in b)
    assert set(seen.values()) == {1} and len(seen) == 40


def test_buckets_keep_padding_low() -> None:
    lengths = _lengths(600, seed=5)
    sampler = LengthBucketBatchSampler(lengths, max_frames=8000, seed=0, num_replicas=1, rank=0)
    batches = list(sampler)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    # Random batching of uniform 40..1000 lengths pads ~60-90 %; sorted buckets stay near a few %.
    assert padded / sum(lengths) < 1.1


def test_epoch_and_seed_control_the_order() -> None:
    lengths = _lengths(120)
    a = LengthBucketBatchSampler(lengths, max_frames=4000, seed=7, num_replicas=1, rank=0)
    b = LengthBucketBatchSampler(lengths, max_frames=4000, seed=7, num_replicas=1, rank=0)
    other_seed = LengthBucketBatchSampler(lengths, max_frames=4000, seed=8, num_replicas=1, rank=0)
    epoch0 = list(a)
    assert epoch0 == list(b)
    assert epoch0 != list(other_seed)
    a.set_epoch(1)
    epoch1 = list(a)
    assert epoch1 != epoch0
    assert sorted(i for x in epoch1 for i in x) == list(range(120))
    no_shuffle = LengthBucketBatchSampler(lengths, max_frames=4000, shuffle=False, num_replicas=1, rank=0)
    first = list(no_shuffle)
    no_shuffle.set_epoch(5)
    assert list(no_shuffle) == first


def test_state_dict_resumes_mid_epoch() -> None:
    lengths = _lengths(90)
    kw = {"max_frames": 3000, "seed": 11, "num_replicas": 2, "rank": 1}
    sampler = LengthBucketBatchSampler(lengths, **kw)
    sampler.set_epoch(2)
    full = list(sampler)
    assert len(full) > 5

    it = iter(sampler)
    done = [next(it) for _ in range(4)]
    assert done == full[:4]
    state = sampler.state_dict()
    assert state["epoch"] == 2 and state["consumed"] == 4

    restored = LengthBucketBatchSampler(lengths, **kw)
    restored.load_state_dict(state)
    restored.set_epoch(2)  # the training loop re-announces the same epoch: resume point kept
    assert list(restored) == full[4:]
    assert restored.state_dict()["consumed"] == len(full)
    assert list(restored) == full  # the skip applies once only
    restored.set_epoch(3)
    assert restored.state_dict()["consumed"] == 0 and len(list(restored)) == len(restored)


@pytest.mark.parametrize("change", ["nothing", "lengths", "max_frames", "seed", "no plan saved"])
def test_a_saved_count_resumes_only_the_same_batches(change, caplog) -> None:
    """A checkpoint's batch count is applied only to the batches it counted: when the clips' lengths
    (ICL: their references), the frame limit or the seed changed, the epoch restarts with a warning
    instead of repeating some clips and skipping others. States saved before the plan was recorded
    resume at their count, as they did."""
    lengths = _lengths(90)
    kw = {"max_frames": 3000, "seed": 11, "num_replicas": 2, "rank": 0}
    sampler = LengthBucketBatchSampler(lengths, **kw)
    sampler.set_epoch(1)
    it = iter(sampler)
    for _ in range(3):
        next(it)
    state = sampler.state_dict()
    if change == "lengths":
        lengths = [n + 40 * (i % 3) for i, n in enumerate(lengths)]
    elif change == "max_frames":
        kw["max_frames"] = 2000
    elif change == "seed":
        kw["seed"] = 12
    elif change == "no plan saved":
        del state["plan"]
    restored = LengthBucketBatchSampler(lengths, **kw)
    with caplog.at_level(logging.WARNING, logger="tts_lightning.data.batching"):
        restored.load_state_dict(state)
    restored.set_epoch(1)
    warned = any("restarting" in r.getMessage() for r in caplog.records)
    full = restored._rank_batches(1)
    if change in ("nothing", "no plan saved"):
        assert not warned and list(restored) == full[3:]
    else:
        assert warned and list(restored) == full
    # Rank 1 takes the same decision and leaves the saying to rank 0 (one line per run, not per rank).
    caplog.clear()
    other = LengthBucketBatchSampler(lengths, **{**kw, "rank": 1})
    with caplog.at_level(logging.WARNING, logger="tts_lightning.data.batching"):
        other.load_state_dict(state)
    other.set_epoch(1)
    assert not caplog.records
    assert list(other) == other._rank_batches(1)[(3 if change in ("nothing", "no plan saved") else 0) :]


def test_oversized_clip_gets_its_own_batch_and_one_warning(caplog) -> None:
    lengths = [100] * 10 + [5000]
    with caplog.at_level(logging.WARNING, logger="tts_lightning.data.batching"):
        sampler = LengthBucketBatchSampler(lengths, max_frames=1000, num_replicas=1, rank=0)
    assert sum("longer than max_frames" in r.getMessage() for r in caplog.records) == 1
    batches = list(sampler)
    assert [10] in batches
    assert all(len(b) * max(lengths[i] for i in b) <= 1000 for b in batches if b != [10])


def test_works_as_a_dataloader_batch_sampler() -> None:
    lengths = _lengths(30)
    data = [torch.full((n,), float(i)) for i, n in enumerate(lengths)]
    sampler = LengthBucketBatchSampler(lengths, batch_size=4, num_replicas=1, rank=0)
    loader = DataLoader(data, batch_sampler=sampler, collate_fn=lambda items: [int(x[0]) for x in items])
    assert sorted(i for b in loader for i in b) == list(range(30))
    assert len(loader) == len(sampler)


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="max_frames, batch_size"):
        LengthBucketBatchSampler([1, 2], num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="rank"):
        LengthBucketBatchSampler([1, 2], batch_size=1, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="empty"):
        LengthBucketBatchSampler([], batch_size=1, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="positive"):
        LengthBucketBatchSampler([3, 0], batch_size=1, num_replicas=1, rank=0)
