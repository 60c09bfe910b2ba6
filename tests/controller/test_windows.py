"""The controller's side of a join window, at the seam: the rules a job's spec gives its
window, the door, and the why-pending line (the end-to-end test is tests/e2e/test_window.py)."""

from __future__ import annotations

from typing import Any

from muster.controller.windows import door, hello_of, open_entry, summary, window_rules
from muster.membership.window import Join, step
from muster.spec import WorkerInventory, parse_job
from muster.spec.worker import WalkIn


def spec(**window: Any) -> Any:
    return parse_job(
        {
            "name": "walk",
            "entrypoint": "train.py",
            "distributed": {
                "num_workers": 3,
                "procs_per_worker": 2,
                "backend": "gloo",
                "membership": "window",
                "window": window,
            },
        }
    )


def walk_in(host: str, ranks: int = 2, torch: str = "2.13.0") -> WorkerInventory:
    return WorkerInventory(
        id=f"walkin-{host}",
        hostname=host,
        torch_version=torch,
        torchrun=True,
        join=WalkIn(job="walk-1", host=host, ranks=ranks),
    )


def test_quorum_and_target_default_to_the_jobs_size_and_manual_has_no_target() -> None:
    auto = window_rules(spec())
    assert (auto.start, auto.quorum, auto.target) == ("auto", 6, 6)
    assert (auto.join_timeout, auto.max_join_timeout) == (300.0, 900.0)
    assert window_rules(spec(quorum=2)).target == 6
    assert window_rules(spec(quorum=8)).target == 8  # never below the quorum
    manual = window_rules(spec(start="manual", quorum=4))
    assert (manual.quorum, manual.target) == (4, None)


def test_the_door_names_the_cohorts_torch_and_a_gpu_job_wants_a_gpu_per_rank() -> None:
    entry = open_entry("walk-1", spec(), "ab" * 32, 0.0)
    assert door(entry, walk_in("a")) == ""
    assert door(entry, walk_in("b", ranks=3)) == ""  # a box brings its own rank count
    first = walk_in("a")
    entry.hellos[first.id] = hello_of(first, "walk-1", "ab" * 32)
    why = door(entry, walk_in("c", torch="2.12.0"))
    assert "c runs torch 2.12.0 but the cohort runs torch 2.13.0" in why


def test_the_why_pending_line_leads_with_the_phase_and_names_the_start() -> None:
    entry = open_entry("walk-1", spec(start="manual", quorum=2), None, 100.0)
    line = summary("walk-1", entry.window, 101.0)
    assert line.startswith("join window waiting: 0 rank(s) in, quorum 2")
    assert "hard cap in 899s" in line
    window, _ = step(entry.window, Join("w", "a", 2), 102.0)
    assert "startable: muster start walk-1" in summary("walk-1", window, 102.0)


def test_a_cuda_job_refuses_a_box_with_fewer_gpus_than_ranks() -> None:
    gpu = parse_job(
        {
            "name": "walk",
            "entrypoint": "train.py",
            "resources": {"gpus": 1},
            "distributed": {"num_workers": 2, "membership": "window"},
        }
    )
    entry = open_entry("walk-1", gpu, None, 0.0)
    why = door(entry, walk_in("cpu", ranks=2))
    assert "cpu offers 2 rank(s) but has 0 GPU(s)" in why
    assert "--devices" in why
