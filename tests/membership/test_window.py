"""The join window, transition by transition (seed 003's diagram), then the operator's start."""

from __future__ import annotations

import pytest

from muster.membership.window import (
    Admitted,
    Ended,
    Failed,
    Formed,
    Join,
    Leave,
    Phase,
    Refused,
    Renumbered,
    Rules,
    Start,
    Started,
    StartMode,
    Tick,
    Window,
    open_window,
    start_refusal,
    step,
)


def rules(start: StartMode = "auto", quorum: int = 2, target: int | None = 4) -> Rules:
    return Rules(start, quorum, None if start == "manual" else target, 60.0, 120.0)


def joined(
    window: Window, *ranks: int, at: float = 1.0, told: list[object] | None = None
) -> Window:
    for i, count in enumerate(ranks, start=len(window.roster)):
        window, out = step(window, Join(f"w{i}", f"host{i}", count), at)
        assert any(isinstance(o, Admitted) for o in out), out
        if told is not None:
            told += out
    return window


# (start mode, ranks joined in order, time of a final tick) -> the phase, and why it formed
TABLE = [
    # auto: waiting -> forming on the target, or on the timeout with the quorum
    ("auto", (1,), 1.0, Phase.WAITING, ""),
    ("auto", (1, 1), 1.0, Phase.WAITING, ""),
    ("auto", (2, 2), 1.0, Phase.FORMING, "target"),
    ("auto", (1, 1), 60.0, Phase.FORMING, "timeout"),
    ("auto", (1,), 60.0, Phase.WAITING, ""),  # timed out below quorum: still waiting
    ("auto", (1,), 120.0, Phase.FAILED, ""),  # hard cap, quorum never met
    # manual: waiting -> staging on the quorum; only the start (or the cap) ends it
    ("manual", (1,), 1.0, Phase.WAITING, ""),
    ("manual", (1, 1), 1.0, Phase.STAGING, ""),
    ("manual", (1, 1, 1, 1, 1), 60.0, Phase.STAGING, ""),  # no target, the timeout holds
    ("manual", (1, 1), 120.0, Phase.FAILED, ""),  # hard cap, start never fired
    ("manual", (1,), 120.0, Phase.FAILED, ""),  # hard cap, quorum never met
    # hybrid: staging as manual; the target or the timeout still form it
    ("hybrid", (1, 1), 1.0, Phase.STAGING, ""),
    ("hybrid", (1, 1, 2), 1.0, Phase.FORMING, "target"),
    ("hybrid", (1, 1), 60.0, Phase.FORMING, "timeout"),
    ("hybrid", (1,), 120.0, Phase.FAILED, ""),
]


@pytest.mark.parametrize(("mode", "ranks", "tick", "phase", "by"), TABLE)
def test_the_window_moves_as_the_seed_draws_it(
    mode: StartMode, ranks: tuple[int, ...], tick: float, phase: Phase, by: str
) -> None:
    told: list[object] = []
    window = joined(open_window(rules(mode), 0.0), *ranks, told=told)
    window, out = step(window, Tick(), tick)
    told += out
    assert window.phase is phase
    assert window.started_by == by
    formed = [o for o in told if isinstance(o, Formed)]
    if phase is Phase.FORMING:
        assert window.formed_at is not None
        assert len(formed) == 1
        assert formed[0].world_size == sum(ranks)
        assert formed[0].roster == window.roster
    else:
        assert formed == []
    if phase is Phase.FAILED:
        assert "max_join_timeout" in window.reason


def test_a_formed_world_is_the_roster_in_admission_order_with_contiguous_ranks() -> None:
    window = open_window(rules(target=6), 0.0)
    window = joined(window, 2, 1)
    window, out = step(window, Join("w2", "host2", 3), 2.0)
    assert out == [Admitted("w2", 3, 3), Formed(window.roster, 6)]
    assert [(m.host, m.first_rank, m.ranks) for m in window.roster] == [
        ("host0", 0, 2),
        ("host1", 2, 1),
        ("host2", 3, 3),
    ]


def test_a_dial_after_forming_is_refused_and_the_world_does_not_grow() -> None:
    window = joined(open_window(rules(), 0.0), 2, 2)
    assert window.phase is Phase.FORMING
    window, out = step(window, Join("late", "late-box", 1), 3.0)
    assert window.ranks == 4
    assert isinstance(out[0], Refused)
    assert "formed without late-box" in out[0].reason
    assert "--persist" in out[0].reason


def test_walk_ins_are_admitted_while_staging() -> None:
    window = joined(open_window(rules("manual"), 0.0), 1, 1)
    assert window.phase is Phase.STAGING
    window = joined(window, 3)
    assert window.phase is Phase.STAGING
    assert window.ranks == 5


def test_a_walk_in_that_leaves_gives_its_ranks_back_and_later_ones_move_down() -> None:
    window = joined(open_window(rules(target=None, quorum=3), 0.0), 2, 1, 3)
    window, out = step(window, Leave("w0"), 2.0)
    assert [(m.worker, m.first_rank) for m in window.roster] == [("w1", 0), ("w2", 1)]
    assert out == [Renumbered(window.roster)]


def test_staging_that_drops_below_quorum_is_no_longer_startable() -> None:
    window = joined(open_window(rules("manual"), 0.0), 1, 1)
    window, _ = step(window, Leave("w1"), 2.0)
    assert window.phase is Phase.WAITING
    window, out = step(window, Start(), 2.0)
    assert window.phase is Phase.WAITING
    assert isinstance(out[0], Refused)
    assert "quorum not met: 1 of 2 ranks" in out[0].reason


@pytest.mark.parametrize(
    ("mode", "ranks", "refused"),
    [
        ("auto", (1, 1), "starts on its own (start: auto)"),
        ("manual", (1,), "quorum not met: 1 of 2 ranks"),
        ("hybrid", (), "quorum not met: 0 of 2 ranks"),
    ],
)
def test_a_start_is_refused_with_its_reason(
    mode: StartMode, ranks: tuple[int, ...], refused: str
) -> None:
    window = joined(open_window(rules(mode), 0.0), *ranks)
    before = window.phase
    window, out = step(window, Start(), 5.0)
    assert window.phase is before
    assert len(out) == 1
    assert isinstance(out[0], Refused)
    assert out[0].worker is None
    assert refused in out[0].reason


def test_the_operator_forms_a_staging_window_and_a_second_start_is_refused() -> None:
    window = joined(open_window(rules("manual"), 0.0), 1, 1, 1)
    window, out = step(window, Start(), 5.0)
    assert window.phase is Phase.FORMING
    assert window.started_by == "operator"
    assert out == [Formed(window.roster, 3)]
    assert "already closed (forming)" in start_refusal(window)


def test_a_hybrid_window_may_be_fired_before_its_clock() -> None:
    window = joined(open_window(rules("hybrid"), 0.0), 1, 1)
    window, _ = step(window, Start(), 5.0)
    assert window.phase is Phase.FORMING


def test_the_formed_world_trains_then_ends() -> None:
    window = joined(open_window(rules(), 0.0), 2, 2)
    window, _ = step(window, Started(), 3.0)
    assert window.phase is Phase.TRAINING
    done, out = step(window, Ended(ok=True), 9.0)
    assert done.phase is Phase.DONE
    assert out == []
    failed, out = step(window, Ended(ok=False, reason="node1 exited 1"), 9.0)
    assert failed.phase is Phase.FAILED
    assert out == [Failed("node1 exited 1")]
    again, out = step(failed, Ended(ok=True), 10.0)
    assert again.phase is Phase.FAILED  # terminal stays terminal
    assert out == []


def test_a_window_cancelled_before_forming_fails_and_ran_nothing() -> None:
    window = joined(open_window(rules("manual"), 0.0), 1, 1)
    window, out = step(window, Ended(ok=True), 3.0)
    assert window.phase is Phase.FAILED
    assert out == [Failed("the run ended before the world formed")]


@pytest.mark.parametrize(
    ("join", "refused"),
    [
        (Join("w0", "other-name", 1), "already on the roster"),
        (Join("wX", "host0", 1), "host name 'host0' is taken"),
        (Join("wY", "box", 0), "offers no ranks"),
    ],
)
def test_a_dial_that_cannot_join_is_refused_by_name(join: Join, refused: str) -> None:
    window = joined(open_window(rules(), 0.0), 1)
    after, out = step(window, join, 2.0)
    assert after.roster == window.roster
    assert isinstance(out[0], Refused)
    assert refused in out[0].reason


def test_the_next_tick_is_the_timeout_then_the_hard_cap_then_none() -> None:
    window = open_window(rules("hybrid"), 100.0)
    assert window.next_tick(101.0) == 160.0
    assert window.next_tick(170.0) == 220.0
    manual = open_window(rules("manual"), 100.0)
    assert manual.next_tick(101.0) == 220.0  # the clock does not form a manual window
    failed, _ = step(window, Tick(), 220.0)
    assert failed.next_tick(221.0) is None


def test_rules_that_cannot_hold_are_refused() -> None:
    with pytest.raises(ValueError, match="no target"):
        Rules("manual", 2, 4, 60, 120)
    with pytest.raises(ValueError, match="target below quorum"):
        Rules("auto", 4, 2, 60, 120)
    with pytest.raises(ValueError, match="max_join_timeout"):
        Rules("auto", 2, 4, 60, 30)
    with pytest.raises(ValueError, match="quorum"):
        Rules("auto", 0, 4, 60, 120)


def test_a_dial_after_the_hard_cap_meets_a_failed_window() -> None:
    window = joined(open_window(rules("manual"), 0.0), 1)
    window, out = step(window, Join("w9", "host9", 1), 130.0)
    assert window.phase is Phase.FAILED
    assert [type(o) for o in out] == [Failed, Refused]
    assert window.ranks == 1
