"""Averaging rounds on real torchrun processes (2 ranks, gloo, CPU)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.train.torchrun import ROOT, torchrun


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("rounds")
    torchrun(ROOT / "tests/train/rounds_worker.py", str(out), timeout=120)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_parameters_identical_and_equal_to_the_weighted_average(
    results: list[dict[str, Any]],
) -> None:
    a, b = results
    assert a["weighted"] == b["weighted"]
    # gamma 1: masses 3 and 1 -> (3 * 1 + 1 * 2) / 4
    assert a["weighted"] == pytest.approx([1.25] * 6)


def test_float_buffers_use_mover_mass_and_integer_buffers_stay_local(
    results: list[dict[str, Any]],
) -> None:
    a, b = results
    # both ranks moved: running means 10 and 20 average with equal weight
    assert a["running_mean"] == b["running_mean"] == pytest.approx([15.0, 15.0])
    assert (a["num_batches_tracked"], b["num_batches_tracked"]) == (5, 6)


def test_a_rank_with_zero_batches_does_not_move_the_average(
    results: list[dict[str, Any]],
) -> None:
    a, b = results
    # gamma 0: without the idle guard rank 1 would vote 0**0 = 1 and pull the average to 1.5
    assert a["zero_rank"] == b["zero_rank"] == pytest.approx([1.0] * 6)


def test_an_all_idle_round_keeps_local_state(results: list[dict[str, Any]]) -> None:
    a, b = results
    assert a["idle"] == pytest.approx([1.0] * 6)
    assert b["idle"] == pytest.approx([2.0] * 6)
    assert not a["idle_realized"]
    assert not b["idle_realized"]


def test_every_rank_issues_the_same_number_of_collectives(
    results: list[dict[str, Any]],
) -> None:
    a, b = results
    assert a["collectives"] == b["collectives"] == [3, 3, 1, 2]


def test_nccl_fuses_the_scale_except_for_bf16_and_gloo_prescales() -> None:
    import torch
    import torch.distributed as dist

    from muster.train.collective import premul_sum_args

    f32, bf16 = torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16)
    assert premul_sum_args(f32, 0.25, "gloo") == (dist.ReduceOp.SUM, True)
    assert premul_sum_args(bf16, 0.25, "nccl") == (dist.ReduceOp.SUM, True)
    op, prescale = premul_sum_args(f32, 0.25, "nccl")
    if hasattr(dist, "_make_nccl_premul_sum"):
        assert not prescale
        assert op != dist.ReduceOp.SUM
    else:  # a torch build without NCCL falls back to pre-scale + SUM
        assert (op, prescale) == (dist.ReduceOp.SUM, True)
