"""The window stopwatch on the host clock: what counts as delivered and what as compute."""

from __future__ import annotations

import time

import torch

from muster.train.elche import Stopwatch


def test_fetch_and_fill_count_as_delivered_not_compute() -> None:
    watch = Stopwatch(torch.device("cpu"))
    time.sleep(0.03)  # the window's fill before its first batch is handed over
    watch.ready()
    time.sleep(0.01)  # compute
    watch.done()
    time.sleep(0.02)  # fetching the next batch
    watch.ready()
    time.sleep(0.01)
    watch.done()
    report = watch.report()
    assert report.batches == 2
    assert report.delivered_ms[0] >= 40
    assert 10 <= report.compute_ms[0] < report.delivered_ms[0] - 25
    assert report.delivered_ms[1] >= 30
    assert 10 <= report.compute_ms[1] < report.delivered_ms[1] - 15
    assert report.fill_excess_ms > 0  # the first batch paid the fill
