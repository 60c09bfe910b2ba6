"""Realized-work mass: the weights every muster.train reduce uses (seed 002, "Realized work").

A mass is the scalar weight riding one rank's contribution to an averaging round. The algebra
has three moves and only three:

1. pre-scale at the source: a rank multiplies its tensors by its mass;
2. sum through folds: scaled tensors and masses add up through any number of tiers (summation
   is associative, so the grouping never changes the result; no tier ever divides);
3. divide once, by the summed mass of exactly the contributions accepted into the round.

Because the sum and its divisor come from the same accepted contributions, a contribution that
never arrived (a dead rank, a lost frame) leaves both, and they cannot disagree.

Two rules belong to the vocabulary:
- the idle guard: a rank that did no work has mass 0 for every policy parameter (raw pow would
  give 0**0 = 1, an idle rank voting at full weight, and 0**-1 = inf, a NaN cohort);
- the zero-mass round rule: a round whose accepted mass is 0 realized nothing; every rank keeps
  its local state.

Nothing here imports torch: the functions work on floats, and ``fold`` / ``divide_once`` work on
anything with ``+`` and ``*`` (floats, numpy arrays, torch tensors).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

from muster.errors import UserError

V = TypeVar("V")


MAX_GAMMA = 4.0  # past it the fastest rank alone decides the average in any real cohort


def gamma_mass(batches: float, gamma: float) -> float:
    """Params-round mass n**gamma, with the idle guard: 0 when the rank did no work. Past
    what a float holds it is inf (never an exception on one rank while its peers wait in a
    collective); ``gamma_shares`` is the overflow-free form when every count is known."""
    if batches <= 0:
        return 0.0
    try:
        return float(float(batches) ** gamma)
    except OverflowError:
        return math.inf


def gamma_shares(counts: Sequence[float], gamma: float) -> list[float]:
    """Every rank's share of a params round, ``n_r**gamma / sum_j n_j**gamma``, computed in
    log space so no count and no gamma overflows; idle ranks get 0 (the idle guard), and an
    all-idle cohort all zeros (the zero-mass round). The same counts give the same shares on
    every rank, bit for bit."""
    logs = [gamma * math.log(n) if n > 0 else None for n in counts]
    live = [x for x in logs if x is not None]
    if not live:
        return [0.0] * len(logs)
    top = max(live)
    weights = [math.exp(x - top) if x is not None else 0.0 for x in logs]
    total = math.fsum(weights)
    return [w / total for w in weights]


def mover_mass(batches: float) -> float:
    """Buffers-round mass: 1 for a rank that moved (did any work), else 0."""
    return 1.0 if batches > 0 else 0.0


def is_realized(total_mass: float) -> bool:
    """Whether a round's accepted mass realized anything (else every rank keeps its state)."""
    return math.isfinite(total_mass) and total_mass > 0.0


@dataclass(frozen=True)
class Contribution(Generic[V]):
    """Pre-scaled values and the mass they were scaled by, as they travel through folds."""

    scaled: V
    mass: float


def prescale(values: V, mass: float) -> Contribution[V]:
    """Move 1: scale at the source. A zero-mass contribution still declares its mass."""
    arithmetic: Any = values
    return Contribution(cast(V, arithmetic * mass), mass)


def fold(parts: Iterable[Contribution[V]]) -> Contribution[V]:
    """Move 2: sum values and masses; never divides, so tiers can nest in any grouping."""
    items = list(parts)
    if not items:
        raise UserError("a fold needs at least one contribution")
    total: Any = items[0].scaled
    mass = items[0].mass
    for part in items[1:]:
        total = total + part.scaled
        mass += part.mass
    return Contribution(cast(V, total), mass)


def divide_once(total: Contribution[V]) -> V | None:
    """Move 3: the consensus, or None when the round realized nothing (keep local state)."""
    if not is_realized(total.mass):
        return None
    arithmetic: Any = total.scaled
    return cast(V, arithmetic * (1.0 / total.mass))
