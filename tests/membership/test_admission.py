"""Admission at the door: each refusal names both sides and the fix."""

from __future__ import annotations

import dataclasses

import pytest

from muster.membership.admission import Hello, refusal

FIRST = Hello("box-a", "nvidia", "2.13.0", "run-1", "f" * 64, None)


def test_the_first_walk_in_sets_the_cohort_and_a_matching_one_is_admitted() -> None:
    assert refusal(None, FIRST, "nccl") == ""
    assert refusal(FIRST, dataclasses.replace(FIRST, host="box-b"), "nccl") == ""


@pytest.mark.parametrize(
    ("change", "backend", "names"),
    [
        ({"vendor": "amd"}, "nccl", ["AMD (ROCm)", "NVIDIA (CUDA)", "box-a", "gloo"]),
        ({"torch": "2.12.1"}, "gloo", ["torch 2.12.1", "torch 2.13.0", "torch==2.13.0"]),
        ({"run": "run-2"}, "gloo", ["run run-2", "run run-1", "dial again"]),
        ({"model_sig": "0" * 64}, "gloo", ["model signature 000000000000", "ffffffffffff"]),
        ({"vendor": None}, "nccl", ["offers no GPU", "gloo"]),
    ],
)
def test_a_walk_in_that_disagrees_is_refused_naming_both_sides(
    change: dict[str, object], backend: str, names: list[str]
) -> None:
    hello = dataclasses.replace(FIRST, host="box-b", **change)  # type: ignore[arg-type]
    why = refusal(FIRST, hello, backend)
    assert "box-b" in why
    for name in names:
        assert name in why, why


def test_cpu_cohorts_may_mix_vendors_under_gloo() -> None:
    amd = dataclasses.replace(FIRST, host="box-b", vendor="amd")
    cpu = dataclasses.replace(FIRST, host="box-c", vendor=None)
    assert refusal(FIRST, amd, "gloo") == ""
    assert refusal(FIRST, cpu, "gloo") == ""


def test_a_dataset_signature_is_compared_when_either_box_holds_data() -> None:
    assert refusal(FIRST, dataclasses.replace(FIRST, host="box-b"), "gloo") == ""  # neither
    late = refusal(FIRST, dataclasses.replace(FIRST, host="box-b", data_sig="1" * 64), "gloo")
    assert "box-b's dataset signature 111111111111 differs from the cohort's none" in late
    with_data = dataclasses.replace(FIRST, data_sig="1" * 64)
    why = refusal(with_data, dataclasses.replace(FIRST, host="box-b", data_sig="2" * 64), "gloo")
    assert "dataset signature 222222222222" in why
    assert "111111111111" in why
    none = refusal(with_data, dataclasses.replace(FIRST, host="box-b"), "gloo")
    assert "dataset signature none" in none
