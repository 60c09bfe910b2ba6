"""A member's start, its exit, and its outputs stored: the job's running and succeeded states
and the first failure that fails it."""

from __future__ import annotations

from muster.gang.actions import RecordEvent, SendStop
from muster.gang.causes import root_cause, upload_cause
from muster.gang.events import MemberExited, MemberStarted, OutputsStored
from muster.gang.network import degraded
from muster.gang.turn import Turn, fail
from muster.spec import JobState, MemberState, PathClass


def member_started(turn: Turn, event: MemberStarted) -> None:
    member = turn.member(event.node)
    if member is None or not member.assigned or member.gone:
        return
    if turn.run.is_over:  # it started after the STOP went out (or was taken for started)
        turn.update(member.node, started=True)
        turn.emit(SendStop(member.worker, turn.run.reason))
        return
    if member.started:
        return
    turn.update(member.node, started=True)
    turn.set_member(member.node, MemberState.RUNNING)
    maybe_running(turn)


def maybe_running(turn: Turn) -> None:
    run = turn.run
    if (
        run.job_state is JobState.RENDEZVOUS
        and run.published is not None
        and all(m.started for m in run.members)
    ):
        turn.set_job(JobState.RUNNING, f"all {len(run.members)} nodes started")


def member_exited(turn: Turn, event: MemberExited) -> None:
    member = turn.member(event.node)
    if member is None or member.gone:
        return
    if not member.assigned:
        # Node 0 could not get its rendezvous ready (no port to listen on): nothing of it
        # runs, and the gang cannot meet without it.
        if member.node == 0 and event.exit_code != 0 and not turn.run.is_over:
            turn.update(0, gone=True)
            turn.set_member(0, MemberState.FAILED, exit_code=event.exit_code)
            turn.release(0)
            cause = root_cause(0, member.worker, event)
            fail(turn, JobState.FAILED, f"{cause} (preparing the rendezvous)")
        return
    node, code, over = member.node, event.exit_code, turn.run.is_over
    if code == 0 and not member.started and not over:
        turn.update(node, started=True)
        turn.set_member(node, MemberState.RUNNING)
        maybe_running(turn)
    turn.update(node, exit_code=code, gone=True, lost=False, unconfirmed=False)
    if code == 0:
        state = MemberState.SUCCEEDED
    elif over and event.signal:
        state = MemberState.CANCELLED
    else:
        state = MemberState.FAILED
    turn.set_member(node, state, exit_code=code, signal=event.signal)
    turn.release(node)
    if code != 0 and not over:
        sockets = turn.run.path in (PathClass.DIRECT, PathClass.RELAYED)
        cause = root_cause(node, member.worker, event, sockets_expected=sockets)
        fail(turn, JobState.FAILED, cause)
    else:
        if turn.run.degraded and not turn.run.is_over:
            degraded(turn, node)  # its device went with it: nobody misses it any more
        _maybe_succeed(turn)


def outputs_stored(turn: Turn, event: OutputsStored) -> None:
    member = turn.member(event.node)
    if member is None or not member.assigned or member.outputs is not None:
        return
    turn.update(member.node, outputs=event.ok)
    if event.ok:
        _maybe_succeed(turn)
        return
    cause = upload_cause(member.node, member.worker, event.errors)
    if not turn.run.is_over:
        fail(turn, JobState.FAILED, cause)
    else:
        turn.emit(
            RecordEvent("OutputsFailed", cause, {"node": member.node, "errors": list(event.errors)})
        )


def _maybe_succeed(turn: Turn) -> None:
    run = turn.run
    if run.job_state is JobState.RUNNING and all(
        m.exit_code == 0 and m.outputs is True for m in run.members
    ):
        turn.set_job(JobState.SUCCEEDED, f"all {len(run.members)} nodes exited 0")
