"""ElChe cadence schedule with synthetic timings."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from muster.errors import UserError
from muster.train.schedule import ElCheSchedule, WindowReport


def window(
    ms: float, batches: int = 5, fill: float = 0.0, compute: float | None = None
) -> WindowReport:
    delivered = [ms + fill] + [ms] * (batches - 1)
    return WindowReport(delivered, [compute if compute is not None else ms] * batches)


def test_no_evidence_means_equal_shares() -> None:
    assert ElCheSchedule(ranks=3, anchor_batches=6).batch_counts() == [6, 6, 6]


def test_slowest_rank_anchors_and_faster_ranks_range_ahead() -> None:
    schedule = ElCheSchedule(ranks=3, anchor_batches=4)
    schedule.record([window(10), window(20), window(40)])
    assert schedule.batch_counts() == [16, 8, 4]


def test_equal_speeds_get_equal_counts() -> None:
    schedule = ElCheSchedule(ranks=2, anchor_batches=5)
    schedule.record([window(12), window(12)])
    assert schedule.batch_counts() == [5, 5]


def test_first_batch_fill_stays_out_of_the_rate() -> None:
    schedule = ElCheSchedule(ranks=2, anchor_batches=4)
    # Rank 0 pays a 500 ms fill once per window; its marginal rate is what counts.
    schedule.record([window(10, fill=500), window(20)])
    assert schedule.batch_counts() == [8, 4]
    assert schedule.fill_excess_ms == [500.0, 0.0]


def test_a_window_where_no_rank_ran_two_batches_drops_to_compute_timing() -> None:
    schedule = ElCheSchedule(ranks=2, anchor_batches=4)
    # No rank has a delivered marginal (one batch each): the compute scale, for every rank.
    reports = [window(10, batches=1, compute=5), window(30, batches=1, compute=20)]
    assert schedule.record(reports) == "compute"
    assert schedule.rate_ms(0) == 5
    assert schedule.rate_ms(1) == 20
    assert schedule.batch_counts() == [16, 4]
    # Back to coherent: the history restarts on the delivered scale, never a mix.
    assert schedule.record([window(10), window(20)]) == "delivered"
    assert schedule.rate_ms(0) == 10
    assert schedule.rate_ms(1) == 20


def test_a_rank_that_ran_one_batch_in_a_coherent_window_is_a_non_mover() -> None:
    schedule = ElCheSchedule(ranks=2, anchor_batches=4)
    schedule.record([window(10), window(20)])
    # Rank 1 ran a single batch (say, the epoch's last): the cohort stays on delivered cost,
    # and rank 1's lone fill-laden batch (300 ms) adds nothing to either history.
    assert schedule.record([window(10), window(300, batches=1, compute=250)]) == "delivered"
    assert schedule.rate_ms(1) == 20
    assert schedule.batch_counts() == [8, 4]


def test_with_an_anchor_of_one_the_slowest_ranks_timing_still_moves() -> None:
    schedule = ElCheSchedule(ranks=2, anchor_batches=1, history=1)
    schedule.record([window(10, batches=1, compute=10), window(400, batches=1, compute=400)])
    assert schedule.batch_counts() == [40, 1]  # the first window: slow warm-up
    for _ in range(2):  # rank 1 warmed up: 40 ms a batch, one batch each window
        schedule.record([window(10, batches=40), window(40, batches=1, compute=40)])
    assert schedule.batch_counts() == [4, 1]  # seen, although it never ran two batches


def test_non_mover_adds_no_evidence() -> None:
    schedule = ElCheSchedule(ranks=2, anchor_batches=4)
    schedule.record([window(10), window(20)])
    schedule.record([window(10), WindowReport([], [])])
    assert schedule.rate_ms(1) == 20


def test_ring_buffer_forgets_old_windows() -> None:
    schedule = ElCheSchedule(ranks=2, anchor_batches=4, history=2)
    for _ in range(2):
        schedule.record([window(10), window(40)])
    for _ in range(2):
        schedule.record([window(10), window(10)])  # rank 1 got faster
    assert schedule.batch_counts() == [4, 4]


@given(
    st.lists(st.floats(min_value=1, max_value=1000), min_size=1, max_size=8),
    st.integers(min_value=1, max_value=32),
    st.integers(min_value=0, max_value=200),
)
def test_a_window_never_exceeds_the_epoch(rates: list[float], anchor: int, left: int) -> None:
    schedule = ElCheSchedule(ranks=len(rates), anchor_batches=anchor)
    schedule.record([window(r) for r in rates])
    counts = schedule.batch_counts(epoch_remaining=left)
    uncapped = schedule.batch_counts()
    assert sum(counts) == min(left, sum(uncapped))
    assert all(0 <= c <= u for c, u in zip(counts, uncapped, strict=True))
    slowest = max(range(len(rates)), key=lambda i: rates[i])
    assert uncapped[slowest] == anchor


def test_bad_reports_are_refused() -> None:
    with pytest.raises(UserError, match="expected 2 reports"):
        ElCheSchedule(ranks=2).record([window(1)])
    with pytest.raises(UserError, match="at least 1"):
        ElCheSchedule(ranks=0)
