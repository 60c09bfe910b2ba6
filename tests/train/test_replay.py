"""The virtual-clock replay of bench/train_replay.py at CI size: real training, simulated time.

It pins what the benchmark's conclusions rest on: the task is one where data parallelism pays
(the regime gate), the replay is deterministic, the proportional-batch baseline makes the same
updates as DDP in less time, and cadence turns the slow rank's work into progress.
"""

from __future__ import annotations

import pytest

from bench.train_replay import SIZES, Arm, Costs, make_data, run

TASK = SIZES["ci"]
GAP = 0.10  # the CI task's final target: H* + 0.10


@pytest.fixture(scope="module")
def data():  # type: ignore[no-untyped-def]
    return make_data(TASK, 0)


def test_the_replay_is_deterministic(data) -> None:  # type: ignore[no-untyped-def]
    arm = Arm("cadence", 2e-3, period=4, gamma=1.0)
    first = run(arm, TASK, data, Costs(k=2), 0, stop_at=data.h_star + 0.2)
    again = run(arm, TASK, data, Costs(k=2), 0, stop_at=data.h_star + 0.2)
    assert first.points == again.points
    assert len(first.points) > 5


def test_the_task_rewards_data_parallelism(data) -> None:  # type: ignore[no-untyped-def]
    target = data.h_star + GAP
    alone = run(Arm("alone", 2e-3), TASK, data, Costs(), 0, stop_at=target)
    ddp = run(Arm("ddp", 2e-3), TASK, data, Costs(), 0, stop_at=target)
    alone_steps = alone.first_below(target, by="samples") / TASK.batch  # type: ignore[operator]
    ddp_steps = ddp.first_below(target, by="samples") / (2 * TASK.batch)  # type: ignore[operator]
    assert ddp_steps <= 0.6 * alone_steps  # the benchmark's regime gate


def test_proportional_batches_make_ddps_updates_in_less_time(data) -> None:  # type: ignore[no-untyped-def]
    costs = Costs(k=2)
    target = data.h_star + 0.2
    ddp = run(Arm("ddp", 2e-3), TASK, data, costs, 0, stop_at=target, eval_every_ms=0)
    prop = run(Arm("ddp-prop", 2e-3), TASK, data, costs, 0, stop_at=target, eval_every_ms=0)
    assert [p[1:] for p in ddp.points] == [p[1:] for p in prop.points]  # same samples, losses
    # A step waits for the slow rank's batch (2c) under DDP, for the busier share under
    # proportional batches (21 and 11 of 32 samples: 13.75 ms): about 1.45x faster.
    speedup = ddp.points[-1][0] / prop.points[-1][0]
    assert 1.4 < speedup < 1.55


def test_cadence_turns_the_slow_ranks_work_into_progress(data) -> None:  # type: ignore[no-untyped-def]
    costs = Costs(k=2)
    target = data.h_star + GAP
    alone = run(Arm("alone", 2e-3), TASK, data, costs, 0, stop_at=target)
    cadence = run(Arm("cadence", 2e-3, period=8, gamma=1.0), TASK, data, costs, 0, stop_at=target)
    t_alone, t_cadence = alone.first_below(target), cadence.first_below(target)
    assert t_alone is not None
    assert t_cadence is not None
    phi = (t_alone / t_cadence - 1) * costs.k
    assert phi > 0.3  # better than dropping the slow rank: it contributed


def test_at_4x_gamma_half_keeps_more_of_the_slow_ranks_work_than_gamma_one(data) -> None:  # type: ignore[no-untyped-def]
    """ElChe's default weight (gamma 0.5, muster/train/elche.py): at k=4 it beats weighing
    by work (gamma 1) and keeps over half of the slow rank's work (phi >= 0.5)."""
    costs = Costs(k=4)
    target = data.h_star + GAP
    alone = run(Arm("alone", 1e-3), TASK, data, costs, 0, stop_at=target).first_below(target)
    times = {
        gamma: run(
            Arm("cadence", 2e-3, period=8, gamma=gamma), TASK, data, costs, 0, stop_at=target
        ).first_below(target)
        for gamma in (0.5, 1.0)
    }
    assert alone is not None
    assert times[0.5] is not None
    assert times[1.0] is not None
    assert times[0.5] < times[1.0]
    assert (alone / times[0.5] - 1) * costs.k >= 0.5
