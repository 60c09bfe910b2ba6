"""WindowSampler: exact per-rank counts, no sample twice in an epoch, same dealing everywhere."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from muster.errors import UserError
from muster.train.sampler import WindowSampler


def deal_epoch(
    size: int, batch: int, world: int, windows: list[list[int]], epoch: int = 0
) -> list[list[list[int]]]:
    """Each rank's batches, window by window, from ``world`` independent samplers."""
    samplers = [WindowSampler(size, batch, rank=r, world=world, seed=3) for r in range(world)]
    for sampler in samplers:
        sampler.start_epoch(epoch)
    out: list[list[list[int]]] = [[] for _ in range(world)]
    for counts in windows:
        left = samplers[0].remaining_batches
        counts = [min(c, max(0, left - sum(counts[:i]))) for i, c in enumerate(counts)]
        for rank, sampler in enumerate(samplers):
            assert sampler.remaining_batches == left
            batches = sampler.deal(counts)
            assert len(batches) == counts[rank]
            assert all(len(b) == batch for b in batches)
            out[rank] += [b.tolist() for b in batches]
    return out


@given(
    size=st.integers(min_value=4, max_value=400),
    batch=st.integers(min_value=1, max_value=16),
    world=st.integers(min_value=1, max_value=4),
    windows=st.lists(st.lists(st.integers(0, 6), min_size=4, max_size=4), max_size=40),
)
def test_no_sample_twice_and_exact_counts(
    size: int, batch: int, world: int, windows: list[list[int]]
) -> None:
    if size < batch:
        return
    dealt = deal_epoch(size, batch, world, [w[:world] for w in windows])
    seen = [i for rank in dealt for b in rank for i in b]
    assert len(seen) == len(set(seen))
    assert set(seen) <= set(range(size))


def test_epochs_are_shuffled_differently_but_reproducibly() -> None:
    first = deal_epoch(64, 8, 2, [[2, 2], [2, 2]], epoch=0)
    again = deal_epoch(64, 8, 2, [[2, 2], [2, 2]], epoch=0)
    second = deal_epoch(64, 8, 2, [[2, 2], [2, 2]], epoch=1)
    assert first == again
    assert first != second
    flat = sorted(i for rank in first for b in rank for i in b)
    assert flat == list(range(64))  # 8 full batches: every sample once


def test_a_window_larger_than_the_epoch_is_refused() -> None:
    sampler = WindowSampler(40, 8, rank=0, world=2)
    sampler.start_epoch(0)
    with pytest.raises(UserError, match="does not fit the 5 left in the epoch"):
        sampler.deal([3, 3])
    assert sampler.remaining_batches == 5  # nothing was taken


def test_bad_arguments_are_named() -> None:
    with pytest.raises(UserError, match="smaller than one batch"):
        WindowSampler(4, 8, rank=0, world=1)
    with pytest.raises(UserError, match="batch_size must be at least 1"):
        WindowSampler(4, 0, rank=0, world=1)
    with pytest.raises(UserError, match="rank 2 is outside a world of 2"):
        WindowSampler(16, 4, rank=2, world=2)
    sampler = WindowSampler(16, 4, rank=0, world=2)
    sampler.start_epoch(0)
    with pytest.raises(UserError, match="expected 2 batch counts"):
        sampler.deal([1])
    with pytest.raises(UserError, match="must not be negative"):
        sampler.deal([1, -1])
