"""The join window under random join / leave / clock / start sequences (hypothesis).

Invariants, checked after every step: the world never forms below the quorum; ranks are
contiguous from 0 in admission order; the world's size never changes after forming; a
terminal phase never changes; and once the hard cap has passed the window is closed.
Examples: ``MUSTER_HYPOTHESIS_EXAMPLES`` (default 300).
"""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from muster.membership.window import (
    Ended,
    Event,
    Formed,
    Join,
    Leave,
    Phase,
    Rules,
    Start,
    Started,
    Tick,
    open_window,
    step,
)

EXAMPLES = int(os.environ.get("MUSTER_HYPOTHESIS_EXAMPLES", "300"))


@st.composite
def window_rules(draw: st.DrawFn) -> Rules:
    start = draw(st.sampled_from(["auto", "manual", "hybrid"]))
    quorum = draw(st.integers(1, 6))
    target = None if start == "manual" else draw(st.none() | st.integers(quorum, 10))
    join_timeout = draw(st.floats(1, 100))
    cap = join_timeout + draw(st.floats(0, 100))
    return Rules(start, quorum, target, join_timeout, cap)


events = st.one_of(
    st.builds(Join, st.sampled_from([f"w{i}" for i in range(8)]), st.just(""), st.integers(0, 3)),
    st.builds(Leave, st.sampled_from([f"w{i}" for i in range(8)])),
    st.just(Start()),
    st.just(Tick()),
    st.just(Started()),
    st.builds(Ended, st.booleans()),
)


@settings(max_examples=EXAMPLES)
@given(
    rules=window_rules(),
    script=st.lists(st.tuples(events, st.floats(0, 30)), max_size=40),
)
def test_random_sequences_keep_the_windows_promises(
    rules: Rules, script: list[tuple[Event, float]]
) -> None:
    window = open_window(rules, 0.0)
    now = 0.0
    world: int | None = None
    for event, later in script:
        now += later
        if isinstance(event, Join):  # a host is named after its link
            event = Join(event.worker, f"host-{event.worker}", event.ranks)
        before = window
        window, out = step(window, event, now)
        formed = [o for o in out if isinstance(o, Formed)]
        assert len(formed) <= 1
        if formed:
            assert before.phase.open
            assert formed[0].world_size >= rules.quorum, "formed below the quorum"
            assert formed[0].world_size == sum(m.ranks for m in formed[0].roster)
            world = formed[0].world_size
        # ranks contiguous from 0, in admission order
        first = 0
        for member in window.roster:
            assert member.first_rank == first
            first += member.ranks
        assert len({m.worker for m in window.roster}) == len(window.roster)
        if world is not None:
            assert window.ranks == world, "the world changed after it formed"
            assert not window.phase.open
        if before.phase.terminal:
            assert window == before, "a terminal window changed"
        if now >= rules.max_join_timeout:
            assert not window.phase.open, "the hard cap passed and the window is still open"
        if window.phase is Phase.STAGING:
            assert window.quorum_met
            assert rules.start != "auto"
        if window.phase is Phase.FORMING and rules.start == "manual":
            assert window.started_by == "operator"
