"""Averaging rounds on real torchrun processes (2 ranks, gloo, CPU)."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

from tests.train.torchrun import ROOT, torchrun


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("rounds")
    torchrun(ROOT / "tests/train/rounds_worker.py", str(out), timeout=120)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def bounds(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("bounds")
    os.environ["MUSTER_TRAIN_DEBUG"] = "1"
    try:
        torchrun(ROOT / "tests/train/round_defects_worker.py", str(out), timeout=120)
    finally:
        del os.environ["MUSTER_TRAIN_DEBUG"]
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


def test_a_round_reduces_in_place_in_bounded_buckets(bounds: list[dict[str, Any]]) -> None:
    for big in (b["big"] for b in bounds):
        assert big["values"] == [1.5]  # 1s and 2s, equal weights, in every slice
        assert big["same_storage"]  # reduced where it lives, not swapped for a copy
        # ~10 MiB of parameters in 1 MiB buckets: COUNT and 11 reduces, and the round
        # allocated about one bucket (the scratch), never a second copy of the model.
        assert big["model_mib"] > 10
        assert big["collectives"] == 1 + 11
        assert big["allocated_mib"] < 2.5


def test_mixed_dtypes_take_a_bucket_each_and_the_count_says_so(
    bounds: list[dict[str, Any]],
) -> None:
    a, b = (x["mixed"] for x in bounds)
    # COUNT, float32 and float64 parameters, the float64 buffer: 4 collectives on each rank.
    assert a["collectives"] == b["collectives"] == 4
    assert a["a"] == b["a"] == pytest.approx(1.25)  # masses 3 and 1
    assert a["b"] == b["b"] == pytest.approx(1.25)
    assert a["mean"] == b["mean"] == pytest.approx(15.0)  # movers weigh the same
    assert (a["weight"], b["weight"]) == (0.75, 0.25)
    assert a["counts"] == b["counts"] == [3, 1]


def test_a_parameter_that_is_not_contiguous_is_averaged_too(
    bounds: list[dict[str, Any]],
) -> None:
    expected = (torch.arange(12.0).reshape(3, 4).t() * 1.5).tolist()
    assert bounds[0]["strided"] == bounds[1]["strided"] == expected


def test_gamma_weighs_in_log_space_and_a_gamma_past_the_bound_is_refused_everywhere(
    bounds: list[dict[str, Any]],
) -> None:
    a, b = bounds
    # 10**12 ** 4 overflows nothing: rank 0's share is 1, rank 1's 1e-48.
    assert a["gamma4"]["a"] == b["gamma4"]["a"] == pytest.approx(1.0)
    assert b["gamma4"]["weight"] == pytest.approx(1e-48)
    for rank in bounds:  # both ranks refused before the COUNT collective: nobody waits
        assert rank["gamma200"] == "gamma must be between 0 and 4; got 200.0"


def test_ranks_at_different_windows_stop_before_anything_is_averaged(
    bounds: list[dict[str, Any]],
) -> None:
    a, b = bounds
    assert "rank 0 is at the averaging round of window 3, but rank 1 at 2" in a["diverged"]
    assert "rank 1 is at the averaging round of window 2, but rank 0 at 3" in b["diverged"]
    assert (a["after_diverged"], b["after_diverged"]) == (1.0, 2.0)  # untouched


def test_the_divergence_triple_is_each_ranks_distance_and_the_norms(
    bounds: list[dict[str, Any]],
) -> None:
    a, b = bounds
    # 16 values: rank 0 at 1, rank 1 at 3, consensus 2: distance 1 x 4, norms 4 / 12 -> 8.
    assert a["triple"] == pytest.approx([4.0, 4.0, 8.0])
    assert b["triple"] == pytest.approx([4.0, 12.0, 8.0])


def test_muster_train_debug_names_every_collective_as_it_is_entered_and_left(
    bounds: list[dict[str, Any]],
) -> None:
    for rank, said in enumerate(b["trace"] for b in bounds):
        assert said == [
            f"[muster.train rank {rank}] enter COUNT (window 7, round)",
            f"[muster.train rank {rank}] exit COUNT (window 7, round)",
            f"[muster.train rank {rank}] enter PARAM 1/1 (float32, 0.00 MiB)",
            f"[muster.train rank {rank}] exit PARAM 1/1",
        ]


def test_ranks_whose_models_differ_in_layout_refuse_before_averaging(
    bounds: list[dict[str, Any]],
) -> None:
    for rank in bounds:
        assert "the models differ in layout" in rank["layouts"]
        assert "nothing of this round was averaged" in rank["layouts"]
