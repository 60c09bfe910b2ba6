"""ElChe training loops on real torchrun processes (2 ranks, gloo, CPU)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from muster.errors import UserError
from tests.train.torchrun import ROOT, torchrun

WORKER = ROOT / "tests/train/elche_worker.py"


def run(tmp_path_factory: pytest.TempPathFactory, scenario: str) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp(scenario)
    torchrun(WORKER, str(out), scenario)
    return [json.loads((out / f"{scenario}{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def cadence(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run(tmp_path_factory, "cadence")


def test_cadence_gives_the_fast_rank_more_batches(cadence: list[dict[str, Any]]) -> None:
    fast = cadence[0]
    # Rank 1 is three times slower; once timings are in, the fast rank ranges ahead (in
    # lockstep the counts would be equal). Under load on 2 cores the measured ratio sinks
    # towards 2x, so the bounds leave room for noise, not for lockstep.
    # (the first window has no timings yet: equal shares, left out. An epoch's last window is
    # cut to the batches left in proportion, so only a cut as small as [1, 1] loses the
    # order: those are left out too. A window may span most of an epoch, and a run may
    # have one window an epoch after the first: every other window counts.)
    windows = fast["windows"]
    later = [w["counts"] for i, w in enumerate(windows) if i >= 1 and sum(w["counts"]) > 2]
    assert later, windows
    assert all(c0 > c1 for c0, c1 in later if c1 > 0), later
    ran = [sum(len(w["indices"]) for w in r["windows"]) for r in cadence]
    assert ran[0] > 1.5 * ran[1], ran


def test_each_rank_runs_exactly_its_count(cadence: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(cadence):
        for window in result["windows"]:
            assert len(window["indices"]) == 64 * window["counts"][rank]
    # Every rank saw the same schedule, so they dealt the epoch the same way.
    assert [w["counts"] for w in cadence[0]["windows"] if w["counts"][1]] == [
        w["counts"] for w in cadence[1]["windows"]
    ]


def test_no_sample_is_seen_twice_in_an_epoch(cadence: list[dict[str, Any]]) -> None:
    for epoch in range(3):
        seen = [
            i
            for result in cadence
            for window in result["windows"]
            if window["epoch"] == epoch
            for i in window["indices"]
        ]
        assert len(seen) == len(set(seen)) == 40 * 64  # every full batch, once
        assert set(seen) <= set(range(40 * 64 + 17))


def test_every_epoch_ends_with_the_same_model_on_every_rank(
    cadence: list[dict[str, Any]],
) -> None:
    fast, slow = cadence
    assert fast["rounds"] == slow["rounds"]
    assert fast["epochs"] == slow["epochs"]
    assert fast["epochs"][0] != fast["epochs"][2]  # and it trained


@pytest.fixture(scope="module")
def sync(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run(tmp_path_factory, "sync")


def test_sync_mode_matches_ddp_with_adamw(sync: list[dict[str, Any]]) -> None:
    """Gradients are averaged before the optimizer steps, so Adam's moments stay equal on
    every rank and each update is DDP's (averaging parameters after local Adam steps is not)."""
    a, b = sync
    assert a["windows"] == b["windows"] == 6  # 3 windows of one batch per rank, 2 epochs
    assert a["params"] == b["params"]
    assert a["params"] == pytest.approx(a["ddp"], rel=1e-5, abs=1e-6)


def test_sync_leaves_no_rank_idle_at_the_end_of_an_epoch(sync: list[dict[str, Any]]) -> None:
    """5 batches for 2 ranks: the fifth waits for the next epoch (drop_last, as
    DistributedSampler(drop_last=True)), so no rank waits in a gradient all-reduce alone."""
    a, b = sync
    assert a["tail_counts"] == b["tail_counts"] == [[1, 1], [1, 1]]
    assert a["tail_windows"] == b["tail_windows"] == 2
    assert a["tail_params"] == b["tail_params"]


def test_sync_stepped_by_hand_still_averages(sync: list[dict[str, Any]]) -> None:
    a, b = sync
    assert a["by_hand_averaged"] is b["by_hand_averaged"] is True
    assert a["by_hand_params"] == b["by_hand_params"]
    assert a["by_hand_params"] != a["tail_params"]  # (and it trained)


def test_a_rank_out_of_step_is_caught_at_the_round(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    for result in run(tmp_path_factory, "diverge"):
        assert "is at the averaging round of window" in result["error"]
        assert "no early break" in result["error"]
        assert "nothing of this round was averaged" in result["error"]
        assert result["moved"] is False


def test_bad_settings_are_refused_before_any_collective() -> None:
    from torch import nn
    from torch.optim import SGD

    from muster.train.elche import ElChe

    model = nn.Linear(2, 1)
    optimizer = SGD(model.parameters(), lr=0.1)
    with pytest.raises(UserError, match=r"needs backend='star'.*itself a barrier"):
        ElChe(model, optimizer, dataset_size=8, batch_size=2, mode="async")
    with pytest.raises(UserError, match="backend must be one of collective, star"):
        ElChe(model, optimizer, dataset_size=8, batch_size=2, backend="nccl")
    with pytest.raises(UserError, match="lookahead must be between 1 and 8"):
        ElChe(model, optimizer, dataset_size=8, batch_size=2, backend="star", mode="async",
              lookahead=0)  # fmt: skip
    with pytest.raises(UserError, match=r"heartbeat_s \(30\) must be .* below timeout_s"):
        ElChe(model, optimizer, dataset_size=8, batch_size=2, heartbeat_s=30, timeout_s=30)
    with pytest.raises(UserError, match="mode must be one of sync, cadence, async"):
        ElChe(model, optimizer, dataset_size=8, batch_size=2, mode="fast")  # type: ignore[arg-type]
    with pytest.raises(UserError, match=r"gamma must be between 0 .* and 4"):
        ElChe(model, optimizer, dataset_size=8, batch_size=2, gamma=float("nan"))
    with pytest.raises(UserError, match=r"gamma must be between 0 .* and 4"):
        ElChe(model, optimizer, dataset_size=8, batch_size=2, gamma=200.0)
    with pytest.raises(UserError, match="init_process_group"):
        ElChe(model, optimizer, dataset_size=8, batch_size=2)


def test_sync_catches_a_cohort_out_of_step_before_averaging_gradients(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    a, b = run(tmp_path_factory, "hazards")
    # A parameter only rank 0 reaches is averaged like the rest (both ranks equal); one
    # nobody reaches keeps grad None and does not move (AdamW's decay skips it, as DDP).
    assert a["branchy"] == b["branchy"]
    assert a["never_moved"] is b["never_moved"] is True
    assert a["never_grad_none"] is b["never_grad_none"] is True
    for result in (a, b):
        assert result["break"] is not None
        assert "is at the averaging round of window" in result["break"]
        assert result["mixed"] is not None
        assert (
            "called ElChe.step for this batch and the others stepped by hand" in (result["mixed"])
        )
