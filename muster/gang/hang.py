"""A running gang whose ranks all went silent (printed nothing, used no CPU): the condition,
the stacks captured at that moment, and on_hang "fail"."""

from __future__ import annotations

from muster.gang.actions import CaptureStacks, RecordEvent, SetCondition
from muster.gang.events import MemberHung
from muster.gang.run import replace
from muster.gang.turn import Turn, fail
from muster.spec import JobState

HANG_STACKS_WAIT_S = 30.0  # on_hang "fail" waits this long at most for the stacks

HANG_FIX = (
    "fix: the stacks in the job's events (HungStacks; `muster stacks JOB` while it runs) show "
    "where each rank waits: most often all but one wait in a collective for the one that "
    "did not reach it"
)


def member_hung(turn: Turn, event: MemberHung) -> None:
    """HUNG from a member (its own, of this epoch: the controller maps it). Whether the job
    is Hung is decided after every event, in ``hung``."""
    member = turn.member(event.node)
    if member is None or turn.run.is_over or not member.started or member.gone:
        return
    if member.hung != event.hung or member.ranks != event.ranks:
        turn.update(member.node, hung=event.hung, ranks=event.ranks)


def hung(turn: Turn) -> None:
    """Hung is raised once the job runs and every member still running is silent and idle
    (naming their ranks; the stacks are captured at that moment; on_hang "fail" fails the
    job once they are in), and lowered when one is not."""
    run = turn.run
    if run.is_over:
        return
    running = [m for m in run.members if not m.gone]
    every = run.job_state is JobState.RUNNING and bool(running) and all(m.hung for m in running)
    if every and not run.hung:
        ranks = ", ".join(
            f"node{m.node} ranks {m.ranks[0]}-{m.ranks[1]}" if m.ranks else f"node{m.node}"
            for m in running
        )
        message = (
            f"epoch {run.epoch}: every rank printed nothing and used no CPU for "
            f"{run.hang_timeout}s (hang_timeout): {ranks}"
        )
        episode = run.hang_episode + 1
        turn.emit(
            SetCondition("Hung", True, "RanksSilent", message),
            RecordEvent("Hung", message, {"epoch": run.epoch, "nodes": [m.node for m in running]}),
            CaptureStacks(message, episode),
        )
        turn.run = replace(turn.run, hung=True, hang_message=message, hang_episode=episode)
        if run.fail_on_hang:  # once the stacks are in (or after a bound): they need the ranks
            turn.run = replace(turn.run, hang_fail_at=turn.now + HANG_STACKS_WAIT_S)
    elif not every and run.hung:
        active = [m for m in running if not m.hung]
        message = f"epoch {run.epoch}: " + (
            ", ".join(f"node{m.node}" for m in active) + " active again"
            if active
            else "the silent members ended"
        )
        turn.emit(
            SetCondition("Hung", False, "RanksActive", message),
            RecordEvent("Unhung", message, {"epoch": run.epoch}),
        )
        turn.run = replace(turn.run, hung=False, hang_fail_at=None)


def fail_hung(turn: Turn, episode: int | None = None) -> None:
    """on_hang "fail": the job ends failed once this episode's stacks are in, or their wait
    is over (``episode`` None: the clock)."""
    run = turn.run
    if run.hang_fail_at is None or run.is_over:
        return
    if episode is not None and episode != run.hang_episode:
        return  # a capture of an earlier episode
    fail(turn, JobState.FAILED, f"hung: {run.hang_message}\n{HANG_FIX}")
