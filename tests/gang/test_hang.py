"""Hung: raised once every running member says its ranks are silent and idle, with their
stacks captured; on_hang "fail" ends the job once they are in (or after a bound); one member
active again lowers it."""

from __future__ import annotations

from dataclasses import replace

from muster.gang import (
    CaptureStacks,
    GangRun,
    MemberExited,
    MemberHung,
    Placed,
    SendStop,
    SetCondition,
    SetJobState,
    StacksCaptured,
    Tick,
    step,
)
from muster.gang.hang import HANG_STACKS_WAIT_S
from muster.spec import JobState, PathClass
from tests.gang.test_lifecycle import CHECKED, PUBLISHED, STARTED, W, run_through

PLACED = Placed("job1", 1, W, PathClass.PRIVATE, master_addr="10.0.0.1", hang_timeout=600)


def running(fail_on_hang: bool) -> GangRun:
    return run_through((replace(PLACED, fail_on_hang=fail_on_hang), PUBLISHED, *CHECKED, *STARTED))


def hung(node: int, yes: bool = True) -> MemberHung:
    return MemberHung(node, yes, (node * 2, node * 2 + 1), 600)


def test_hung_is_raised_when_every_member_is_silent_and_lowered_when_one_speaks() -> None:
    run = running(fail_on_hang=False)
    for node in (0, 1):
        run, actions = step(run, hung(node), 10)
        assert actions == (), "two of three are silent: not the whole job"
    run, actions = step(run, hung(2), 10)
    (condition,) = [a for a in actions if isinstance(a, SetCondition)]
    assert (condition.type, condition.status, condition.reason) == ("Hung", True, "RanksSilent")
    assert "node0 ranks 0-1, node1 ranks 2-3, node2 ranks 4-5" in condition.message
    assert "for 600s (hang_timeout)" in condition.message
    assert any(isinstance(a, CaptureStacks) for a in actions)
    assert not any(isinstance(a, SetJobState) for a in actions), "on_hang warn: it goes on"
    run, actions = step(run, hung(2), 11)
    assert actions == (), "said twice, raised once"
    run, actions = step(run, hung(1, yes=False), 12)
    (lowered,) = [a for a in actions if isinstance(a, SetCondition)]
    assert (lowered.status, lowered.reason) == (False, "RanksActive")
    assert "node1 active again" in lowered.message
    run, actions = step(run, StacksCaptured(1), 13)
    assert run.job_state is JobState.RUNNING


def test_on_hang_fail_ends_the_job_once_the_stacks_are_in() -> None:
    run = running(fail_on_hang=True)
    for node in (0, 1, 2):
        run, actions = step(run, hung(node), 100)
    assert run.job_state is JobState.RUNNING, "not before the stacks are read"
    assert any(isinstance(a, CaptureStacks) for a in actions)
    run, actions = step(run, StacksCaptured(1), 105)
    assert run.job_state is JobState.FAILED
    (failed,) = [a for a in actions if isinstance(a, SetJobState)]
    assert failed.reason.startswith("hung: epoch 1: every rank printed nothing")
    assert "\nfix: the stacks in the job's events" in failed.reason
    assert {a.worker for a in actions if isinstance(a, SendStop)} == set(W)


def test_on_hang_fail_does_not_wait_for_stacks_forever() -> None:
    run = running(fail_on_hang=True)
    for node in (0, 1, 2):
        run, _ = step(run, hung(node), 100)
    run, _ = step(run, Tick(), 100 + HANG_STACKS_WAIT_S - 1)
    assert run.job_state is JobState.RUNNING
    run, _ = step(run, Tick(), 100 + HANG_STACKS_WAIT_S)
    assert run.job_state is JobState.FAILED


def test_a_member_active_again_before_the_stacks_are_in_saves_the_job() -> None:
    run = running(fail_on_hang=True)
    for node in (0, 1, 2):
        run, _ = step(run, hung(node), 100)
    run, _ = step(run, hung(0, yes=False), 101)
    run, _ = step(run, StacksCaptured(1), 102)
    run, _ = step(run, Tick(), 100 + HANG_STACKS_WAIT_S + 1)
    assert run.job_state is JobState.RUNNING


def test_a_member_that_ends_while_the_rest_wait_leaves_a_hung_job() -> None:
    """One node finished (exit 0); the others wait in a collective for it for ever."""
    run = running(fail_on_hang=False)
    for node in (0, 1):
        run, actions = step(run, hung(node), 10)
        assert not any(isinstance(a, CaptureStacks) for a in actions)
    run, actions = step(run, MemberExited(2, 0), 11)
    assert any(isinstance(a, CaptureStacks) for a in actions), actions
    assert run.hung


def test_no_hung_before_every_member_runs() -> None:
    """Node 0's torchrun waits in the rendezvous, silent and idle, while the others still
    prepare: not a hang."""
    run = run_through((PLACED, PUBLISHED, *CHECKED, STARTED[0]))
    run, actions = step(run, hung(0), 700)
    assert not run.hung
    assert not any(isinstance(a, CaptureStacks) for a in actions)


def test_a_late_capture_of_an_earlier_episode_fails_nothing() -> None:
    run = running(fail_on_hang=True)
    for node in (0, 1, 2):
        run, _ = step(run, hung(node), 100)
    run, _ = step(run, hung(0, yes=False), 101)  # episode 1 over
    run, _ = step(run, hung(0), 102)  # episode 2
    assert run.hang_episode == 2
    run, _ = step(run, StacksCaptured(1), 103)
    assert run.job_state is JobState.RUNNING
    run, _ = step(run, StacksCaptured(2), 104)
    assert run.job_state is JobState.FAILED


def test_a_restarted_controller_lowers_hung_until_the_agents_say_it_again() -> None:
    from muster.gang import ControllerRestarted, MemberSnapshot
    from muster.spec import MemberState

    snapshots = [MemberSnapshot(worker=w, state=MemberState.RUNNING, assigned=True) for w in W]
    restored = GangRun.restore(
        "job1", 1, PathClass.PRIVATE, JobState.RUNNING, snapshots, published=("10.0.0.1", 1)
    )
    run = replace(restored, hang_timeout=600, fail_on_hang=True)
    run, actions = step(run, ControllerRestarted(grace_deadline=50), 0)
    lowered = [a for a in actions if isinstance(a, SetCondition) and a.type == "Hung"]
    assert [(a.status, a.reason) for a in lowered] == [(False, "ControllerRestarted")]
    assert not run.hung
