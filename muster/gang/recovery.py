"""What a run does when an agent's link drops or comes back, when the clock passes one of
its deadlines, and after a controller restart."""

from __future__ import annotations

from muster.gang.actions import RecordEvent, SendPrepareRendezvous, SendStop, SetCondition
from muster.gang.events import ControllerRestarted, LinkBack, LinkLost, MemberExited
from muster.gang.gating import maybe_assign, maybe_check
from muster.gang.hang import fail_hung
from muster.gang.members import maybe_running, member_exited
from muster.gang.network import probe_budget
from muster.gang.run import GangPhase, Member, replace
from muster.gang.turn import (
    BUILT_PATHS,
    MASTER_CHECK_BUDGET_S,
    RENDEZVOUS_TIMEOUT_S,
    Turn,
    fail,
    fence,
    with_everyone,
)
from muster.spec import JobState, MemberState, PathClass

_BEFORE_RENDEZVOUS = (JobState.PLACING, JobState.NETWORKING)


def _awaits_outputs(member: Member) -> bool:
    return member.exit_code == 0 and member.outputs is None


def link_lost(turn: Turn, event: LinkLost) -> None:
    node = turn.run.node_of(event.worker)
    if node is None or turn.run.members[node].lost:
        return
    member = turn.update(node, lost=True)
    over = turn.run.is_over
    who = f"node{node} (worker {member.worker}) was lost"
    if member.gone:
        if _awaits_outputs(member) and not over:
            fail(turn, JobState.FAILED, f"{who} before its outputs were stored: {event.why}")
        return
    if member.released:
        return  # never started, already given back
    turn.set_member(node, MemberState.LOST)
    if not member.assigned:
        turn.release(node)
    if not over and len(turn.run.members) > 1 and not any(m.assigned for m in turn.run.members):
        # Before any rank started nothing of the user's is lost: place the gang again (the
        # lost worker is offline, so the next gang is formed without it).
        cause = f"{who} before any rank started: {event.why}"
        fence(turn, cause, [], "MemberLost", network=False)
    elif not over:
        fail(turn, JobState.FAILED, f"{who}: {event.why}")


def link_back(turn: Turn, event: LinkBack) -> None:
    run = turn.run
    node = run.node_of(event.worker)
    if node is None:
        return
    report = next(
        (r for r in event.members if r.job == run.job and r.epoch == run.epoch and r.node == node),
        None,
    )
    was_unconfirmed = run.members[node].unconfirmed
    member = turn.update(node, lost=False, unconfirmed=False)
    over = run.is_over
    who = f"node{node} (worker {member.worker}) was lost"
    if not member.assigned and report is not None and report.exit_code is None:
        # It runs although the store never saw its ASSIGN (the controller stopped between
        # the two): take it as assigned and started, and go on from there.
        turn.update(node, assigned=True)
        if over:
            turn.emit(SendStop(member.worker, run.reason))
        else:
            turn.update(node, started=True)
            turn.set_member(node, MemberState.RUNNING)
    elif not member.assigned:
        if (
            node == 0
            and run.phase is GangPhase.RENDEZVOUS
            and run.job_state is JobState.RENDEZVOUS
            and not over
        ):
            turn.emit(SendPrepareRendezvous(member.worker, run.master_addr, run.port))
            turn.update(0, holding=True)
    elif member.gone:
        if report is None and _awaits_outputs(member) and not over:
            fail(turn, JobState.FAILED, f"{who} before its outputs were stored")
    elif report is None:
        turn.update(node, gone=True)
        turn.set_member(node, MemberState.LOST)
        turn.release(node)
        if not over:
            fail(turn, JobState.FAILED, f"{who}: its agent dialled back without the member")
    elif report.exit_code is None:
        if over:
            turn.emit(SendStop(member.worker, run.reason))
        elif not member.started:
            turn.update(node, started=True)
            turn.set_member(node, MemberState.RUNNING)
    else:
        member_exited(turn, MemberExited(node, report.exit_code, report.signal))
    if was_unconfirmed:
        maybe_check(turn)
        maybe_assign(turn)
    maybe_running(turn)


def tick(turn: Turn) -> None:
    run = turn.run
    if not run.is_over and run.deadline is not None and turn.now > run.deadline:
        fail(turn, JobState.FAILED, f"timed out after {run.timeout}s (spec.timeout)")
    if turn.run.hang_fail_at is not None and turn.now >= turn.run.hang_fail_at:
        fail_hung(turn)
    if (
        not turn.run.is_over
        and turn.run.published is None
        and turn.run.rendezvous_deadline is not None
        and turn.now > turn.run.rendezvous_deadline
        and not any(m.unconfirmed for m in turn.run.members)
    ):
        node0 = turn.run.members[0]
        probing = turn.run.probe_seconds is not None and all(
            m.net_up or not m.networked for m in turn.run.members
        )
        if turn.run.job_state is JobState.NETWORKING and probing:
            slow = [
                m
                for m in turn.run.members
                if m.probe_port is None or m.node in turn.run.probe_pending
            ]
            fence(
                turn,
                f"the probe did not finish within {probe_budget(turn.run):.0f}s: "
                + ", ".join(
                    f"node{m.node} (worker {m.worker}) "
                    + ("did not open its endpoint" if m.probe_port is None else "did not report")
                    for m in slow
                ),
                [pair for m in slow for pair in with_everyone(turn.run, m.node)],
                "ProbeFailed",
            )
        elif turn.run.job_state is JobState.NETWORKING:
            late = [m for m in turn.run.members if not m.net_up]
            fence(
                turn,
                f"the direct network was not up within {RENDEZVOUS_TIMEOUT_S:.0f}s: "
                + ", ".join(
                    f"node{m.node} (worker {m.worker}) "
                    + ("had no key" if m.net_key is None else "did not set its peers")
                    for m in late
                ),
                [pair for m in late for pair in with_everyone(turn.run, m.node)],
                "DirectPathFailed",
            )
        elif turn.run.checking is not None:
            late = [m for m in turn.run.members if m.checked is None]
            fence(
                turn,
                f"the members did not answer the check of node0's rendezvous within "
                f"{MASTER_CHECK_BUDGET_S:.0f}s: "
                + ", ".join(f"node{m.node} (worker {m.worker})" for m in late),
                [pair for m in late for pair in with_everyone(turn.run, m.node)],
                "MasterUnreachable",
            )
        else:
            fail(
                turn,
                JobState.FAILED,
                f"node0 (worker {node0.worker}) did not publish its rendezvous address within "
                f"{RENDEZVOUS_TIMEOUT_S:.0f}s",
            )
    if turn.run.grace_deadline is None or turn.now < turn.run.grace_deadline:
        return
    turn.run = replace(turn.run, grace_deadline=None)
    late = [m for m in turn.run.members if m.unconfirmed]
    for member in late:
        turn.update(member.node, unconfirmed=False)
        if not member.gone:
            turn.set_member(member.node, MemberState.LOST)
        if not member.assigned:
            turn.release(member.node)
    if late and not turn.run.is_over:
        first = late[0]
        more = f" (nor did {len(late) - 1} more)" if len(late) > 1 else ""
        cause = (
            f"node{first.node} (worker {first.worker}) did not dial back within the grace "
            f"after the controller restarted{more}"
        )
        if len(turn.run.members) > 1 and not any(m.assigned for m in turn.run.members):
            fence(turn, cause, [], "MemberLost", network=False)  # nothing of the user's ran
        else:
            fail(turn, JobState.FAILED, cause)


def restarted(turn: Turn, event: ControllerRestarted) -> None:
    turn.run = replace(
        turn.run,
        grace_deadline=event.grace_deadline,
        rendezvous_deadline=event.grace_deadline + RENDEZVOUS_TIMEOUT_S,
    )
    run = turn.run
    unstarted = len(run.members) > 1 and not any(m.assigned for m in run.members)
    if unstarted and (
        run.job_state is JobState.NETWORKING or (run.path in BUILT_PATHS and run.published is None)
    ):
        # The join keys, the mesh addresses and the probe's progress of a network not yet
        # in use went with the controller's memory, and nothing of the user's ran: fence
        # the epoch and place the gang again. (Its devices come down on the agents' side:
        # an agent that dials in again drops a device no member of its uses, and a new
        # epoch's device replaces an old one.)
        cause = "the controller restarted while the gang's network was being set up"
        fence(turn, cause, [], "ControllerRestarted", network=False)
        return
    if run.job_state in _BEFORE_RENDEZVOUS:
        turn.set_job(
            JobState.RENDEZVOUS, f"epoch {run.epoch}: waiting for node0 to publish its address"
        )
    if run.hang_timeout is not None and run.job_state is JobState.RUNNING:
        # Whether its ranks were hung went with the controller's memory: a Hung on record is
        # lowered, and raised again if the agents that dial back say so (they resend HUNG).
        turn.emit(
            SetCondition(
                "Hung", False, "ControllerRestarted", "re-read from the agents as they dial back"
            )
        )
    if run.path is PathClass.DIRECT and len(run.members) > 1 and not run.is_over:
        # Whether a pair had lost its path went with the controller's memory: the agents
        # say their paths again on their new links, and the condition follows.
        turn.run = replace(turn.run, degraded=None)
        run = turn.run
    waiting = []
    for member in run.members:
        if member.released:
            continue
        if run.is_over and not member.assigned:
            turn.release(member.node)
        elif not member.gone or (_awaits_outputs(member) and not run.is_over):
            turn.update(member.node, unconfirmed=True, lost=True)
            waiting.append(member.node)
    if waiting:
        turn.emit(
            RecordEvent(
                "AwaitingMembers",
                f"epoch {run.epoch}: the controller restarted; waiting for "
                + ", ".join(f"node{n}" for n in waiting)
                + " to dial back",
                {"nodes": waiting, "grace_deadline": event.grace_deadline},
            )
        )
