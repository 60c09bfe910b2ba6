"""Realized-work mass algebra: the idle guard, and any fold grouping gives one answer."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from muster.errors import UserError
from muster.train.mass import (
    Contribution,
    divide_once,
    fold,
    gamma_mass,
    gamma_shares,
    is_realized,
    mover_mass,
    prescale,
)

gammas = st.floats(min_value=-3, max_value=3, allow_nan=False)


@given(gammas)
def test_idle_rank_has_zero_mass_for_every_gamma(gamma: float) -> None:
    assert gamma_mass(0, gamma) == 0.0
    assert mover_mass(0) == 0.0


@pytest.mark.parametrize(
    ("n", "gamma", "mass"),
    [(4, 0.0, 1.0), (4, 1.0, 4.0), (4, 0.5, 2.0), (4, -1.0, 0.25), (1, 7.0, 1.0)],
)
def test_gamma_mass_of_working_ranks(n: int, gamma: float, mass: float) -> None:
    assert gamma_mass(n, gamma) == pytest.approx(mass)
    assert mover_mass(n) == 1.0


def test_zero_mass_round_is_not_realized() -> None:
    assert not is_realized(0.0)
    assert not is_realized(math.nan)
    assert is_realized(1e-9)
    idle = fold([prescale(np.ones(3), gamma_mass(0, 0.0)), prescale(np.ones(3), 0.0)])
    assert divide_once(idle) is None


vectors = st.lists(
    st.floats(min_value=-1e3, max_value=1e3, allow_nan=False), min_size=3, max_size=3
)
work = st.integers(min_value=0, max_value=50)


@given(st.lists(st.tuples(vectors, work), min_size=1, max_size=8), gammas, st.randoms())
def test_any_grouping_of_folds_gives_the_flat_weighted_average(
    ranks: list[tuple[list[float], int]], gamma: float, rnd: object
) -> None:
    parts = [prescale(np.array(v), gamma_mass(n, gamma)) for v, n in ranks]
    flat = divide_once(fold(parts))
    # Split into random fold tiers (e.g. per-host relays), fold each, then fold the folds.
    shuffled = list(parts)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    cut = rnd.randint(1, len(shuffled))  # type: ignore[attr-defined]
    tiers = [fold(shuffled[:cut])] + ([fold(shuffled[cut:])] if shuffled[cut:] else [])
    nested = divide_once(fold(tiers))
    masses = [gamma_mass(n, gamma) for _, n in ranks]
    if sum(masses) == 0:
        assert flat is None
        assert nested is None
        return
    expected = sum(np.array(v) * m for (v, _), m in zip(ranks, masses, strict=True)) / sum(masses)
    assert flat is not None
    assert nested is not None
    np.testing.assert_allclose(flat, expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(nested, flat, rtol=1e-6, atol=1e-6)


@given(
    st.lists(st.tuples(vectors, st.integers(1, 50)), min_size=2, max_size=8),
    st.integers(min_value=0, max_value=7),
)
def test_a_contribution_left_out_leaves_sum_and_divisor(
    ranks: list[tuple[list[float], int]], dropped: int
) -> None:
    dropped %= len(ranks)
    parts = [prescale(np.array(v), gamma_mass(n, 1.0)) for v, n in ranks]
    accepted = [p for i, p in enumerate(parts) if i != dropped]
    total = fold(accepted)
    assert total.mass == pytest.approx(sum(p.mass for p in accepted))
    kept = [r for i, r in enumerate(ranks) if i != dropped]
    expected = sum(np.array(v) * n for v, n in kept) / sum(n for _, n in kept)
    result = divide_once(total)
    assert result is not None
    np.testing.assert_allclose(result, expected, rtol=1e-6, atol=1e-6)


def test_fold_needs_something() -> None:
    with pytest.raises(UserError, match="at least one"):
        fold([])
    assert fold([Contribution(2.0, 1.0)]).scaled == 2.0


def test_gamma_shares_never_overflow_and_agree_with_the_masses() -> None:
    assert gamma_shares([3, 1], 1.0) == pytest.approx([0.75, 0.25])
    assert gamma_shares([4, 0], 0.0) == [1.0, 0.0]  # the idle guard
    assert gamma_shares([0, 0], 1.0) == [0.0, 0.0]  # nothing realized
    huge = gamma_shares([1000, 200], 200.0)  # 1000**200 is past any float
    assert huge[0] == pytest.approx(1.0)
    assert 0.0 <= huge[1] < 1e-100
    assert sum(gamma_shares([10**12, 7, 1], 4.0)) == pytest.approx(1.0)
    masses = [gamma_mass(n, 0.5) for n in (9, 4, 1)]
    assert gamma_shares([9, 4, 1], 0.5) == pytest.approx([m / sum(masses) for m in masses])


def test_gamma_mass_past_a_float_is_inf_not_an_exception() -> None:
    assert gamma_mass(1000, 200.0) == float("inf")
