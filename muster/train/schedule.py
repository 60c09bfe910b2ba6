"""The ElChe cadence schedule: how many batches each rank runs in the next window (seed 002).

N ranks are treated as one logical device split into per-rank batch counts. The slowest
rank is the anchor and runs ``anchor_batches``; a rank k times faster runs k times as many,
so every rank reaches the averaging round at about the same moment instead of the fast ones
idling at a barrier.

Timing feed, per window and rank:
- the window's first batch is the *fill* (plan pickup, prefetch spin-up, the first
  unpipelined copy). It is kept out of the marginal rate; its excess over that rate is kept
  apart as ``fill_excess_ms``, because a fixed cost must not scale a rank's allocation;
- batches 2..n give the marginal *delivered* cost (compute + data + transport);
- a window is *coherent* when some rank has a delivered marginal (it ran two batches or
  more). Then each rank with one feeds its delivered cost, and a rank that ran exactly one
  batch (its fill alone: no marginal) adds nothing to the delivered scale (seed 002's
  attested non-mover) rather than sending the whole cohort to the compute scale; it still
  feeds its compute time (unlike the seed), or with ``anchor_batches=1`` the slowest rank,
  one batch every window, would keep its first window's timing for ever. A window in
  which no rank ran two batches is not coherent: every rank that worked feeds its compute
  time instead. Each scale keeps its own history, so the two never mix;
- a rank that ran no batch is a non-mover: it adds nothing to the history.
Rates are the mean over a ring buffer of recent windows. A window never exceeds what is left
of the epoch. Pure: no clock, no torch.

Reports come as ``WindowReport`` (batch by batch, as a rank measures them) or as
``WindowSummary`` (the four figures a rank sends its peers at the averaging round).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from muster.errors import UserError

Scale = Literal["delivered", "compute"]


class Report(Protocol):
    """What the schedule reads of one rank's window."""

    @property
    def batches(self) -> int: ...
    @property
    def marginal_ms(self) -> float | None: ...
    @property
    def fill_excess_ms(self) -> float: ...
    @property
    def compute_rate_ms(self) -> float | None: ...


@dataclass(frozen=True)
class WindowSummary:
    """A window reduced to the figures the schedule needs (what travels between ranks)."""

    batches: int
    marginal_ms: float | None
    fill_excess_ms: float
    compute_rate_ms: float | None


@dataclass(frozen=True)
class WindowReport:
    """What one rank measured in one window, batch by batch, in milliseconds."""

    delivered_ms: Sequence[float]  # wall time per batch as delivered (compute + data + wire)
    compute_ms: Sequence[float]  # the compute part of each batch

    @property
    def batches(self) -> int:
        return len(self.delivered_ms)

    @property
    def marginal_ms(self) -> float | None:
        """Mean delivered cost of batches 2..n; None with fewer than two batches."""
        rest = self.delivered_ms[1:]
        return sum(rest) / len(rest) if rest else None

    @property
    def fill_excess_ms(self) -> float:
        """How much longer the first batch took than the marginal rate (never negative)."""
        marginal = self.marginal_ms
        if marginal is None or not self.delivered_ms:
            return 0.0
        return max(0.0, self.delivered_ms[0] - marginal)

    @property
    def compute_rate_ms(self) -> float | None:
        return sum(self.compute_ms) / len(self.compute_ms) if self.compute_ms else None

    def summary(self) -> WindowSummary:
        return WindowSummary(
            self.batches, self.marginal_ms, self.fill_excess_ms, self.compute_rate_ms
        )


@dataclass
class ElCheSchedule:
    """Per-rank batch counts from a ring buffer of recent windows' timings."""

    ranks: int
    anchor_batches: int = 8
    history: int = 4
    scale: Scale = "delivered"
    rings: dict[Scale, list[deque[float]]] = field(default_factory=dict)
    fill_excess_ms: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.ranks < 1 or self.anchor_batches < 1 or self.history < 1:
            raise UserError("ranks, anchor_batches and history must all be at least 1")
        self.rings = {
            scale: [deque(maxlen=self.history) for _ in range(self.ranks)]
            for scale in ("delivered", "compute")
        }
        self.fill_excess_ms = [0.0] * self.ranks

    def record(self, reports: Sequence[Report]) -> Scale:
        """Feed one window's reports (one per rank); returns the scale it was read on."""
        if len(reports) != self.ranks:
            raise UserError(f"expected {self.ranks} reports, got {len(reports)}")
        coherent = any(r.marginal_ms is not None for r in reports)
        self.scale = "delivered" if coherent else "compute"
        for rank, report in enumerate(reports):
            if report.batches == 0:
                continue  # a non-mover: no evidence either way
            compute = report.compute_rate_ms
            if compute is not None and compute > 0:
                # (a rank that ran one batch still times its compute: with anchor_batches=1
                # the slowest rank runs one batch every window, and its evidence must move)
                self.rings["compute"][rank].append(compute)
            if coherent and report.marginal_ms is None:
                continue  # one batch in a coherent window: no delivered sample (its fill only)
            delivered = report.marginal_ms
            if coherent and delivered is not None and delivered > 0:
                self.rings["delivered"][rank].append(delivered)
                self.fill_excess_ms[rank] = report.fill_excess_ms
        return self.scale

    def rate_ms(self, rank: int, scale: Scale | None = None) -> float | None:
        """A rank's mean per-batch cost on ``scale`` (default: the last window's)."""
        ring = self.rings[scale or self.scale][rank]
        return sum(ring) / len(ring) if ring else None

    def batch_counts(self, epoch_remaining: int | None = None) -> list[int]:
        """The next window: the slowest rank runs anchor_batches, faster ranks range ahead,
        and the total never exceeds ``epoch_remaining`` batches."""
        counts = [self.anchor_batches] * self.ranks  # no evidence yet: equal shares
        # The last window's scale if every rank has evidence on it, else the compute scale
        # (every mover feeds it); never a mix of the two.
        for scale in (self.scale, "compute"):
            rates = [self.rate_ms(r, scale) for r in range(self.ranks)]
            known = [r for r in rates if r is not None]
            if len(known) == self.ranks:
                slowest = max(known)
                counts = [max(1, round(self.anchor_batches * slowest / r)) for r in known]
                break
        if epoch_remaining is not None:
            counts = cap_counts(counts, max(0, epoch_remaining))
        return counts


def cap_counts(counts: list[int], limit: int) -> list[int]:
    """Scale counts down so they sum to at most ``limit``, keeping their proportions."""
    total = sum(counts)
    if total <= limit:
        return counts
    scaled = [c * limit / total for c in counts]
    out = [int(s) for s in scaled]
    # Hand the leftover batches to the largest remainders, so nothing of the epoch is lost.
    order = sorted(range(len(out)), key=lambda i: scaled[i] - out[i], reverse=True)
    for i in order[: limit - sum(out)]:
        out[i] += 1
    return out
