"""The window stopwatch on the host clock: what counts as delivered and what as compute."""

from __future__ import annotations

import time

import torch

from muster.train.elche import Stopwatch


def test_fetch_and_fill_count_as_delivered_not_compute() -> None:
    watch = Stopwatch(torch.device("cpu"))
    # the window's fill before its first batch is handed over: 60 ms more than the second
    # batch's fetch, so a late wake-up (tens of ms on a busy runner) cannot hide it
    time.sleep(0.08)
    watch.ready()
    time.sleep(0.01)  # compute
    watch.done()
    time.sleep(0.02)  # fetching the next batch
    watch.ready()
    time.sleep(0.01)
    watch.done()
    report = watch.report()
    assert report.batches == 2
    assert report.delivered_ms[0] >= 90
    assert 10 <= report.compute_ms[0] < report.delivered_ms[0] - 25
    assert report.delivered_ms[1] >= 30
    assert 10 <= report.compute_ms[1] < report.delivered_ms[1] - 15
    assert report.fill_excess_ms > 0  # the first batch paid the fill
