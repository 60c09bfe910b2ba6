"""What every part of the lifecycle shares: a step's ``Turn`` (the run as it changes and the
actions decided so far), the deadlines, and how a run fails, is fenced or is stopped."""

from __future__ import annotations

from typing import Any

from muster.gang.actions import (
    Action,
    KeepApart,
    RecordEvent,
    ReleaseWorker,
    SendStop,
    SetCondition,
    SetJobState,
    SetMemberState,
    SmallerPackets,
)
from muster.gang.run import GangRun, Member, replace
from muster.plan import MESH_MTU
from muster.spec import JobState, MemberState, PathClass

_FORWARD = (
    MemberState.PENDING,
    MemberState.ASSIGNED,
    MemberState.STARTING,
    MemberState.RUNNING,
    MemberState.SUCCEEDED,
)

BUILT_PATHS = (PathClass.DIRECT, PathClass.RELAYED)  # the paths muster sets up per epoch

RENDEZVOUS_TIMEOUT_S = 120.0  # node 0 answers PREPARE_RENDEZVOUS within this, or the job fails

# Every member answers MASTER_CHECK within this (its agent dials for 10 s at most and reads
# the versions in its Python meanwhile), or the epoch is fenced.
MASTER_CHECK_BUDGET_S = 30.0

# A gang whose network fails before its command starts is placed again (a new epoch, its
# failed pairs kept apart); in this epoch, it fails instead.
MAX_NETWORK_EPOCHS = 3


class Turn:
    """The run as one step changes it, and the actions decided so far."""

    def __init__(self, run: GangRun, now: float) -> None:
        self.run = run
        self.now = now
        self.actions: list[Action] = []

    def emit(self, *actions: Action) -> None:
        self.actions.extend(actions)

    def member(self, node: int) -> Member | None:
        return self.run.members[node] if 0 <= node < len(self.run.members) else None

    def update(self, node: int, **changes: Any) -> Member:
        members = list(self.run.members)
        members[node] = replace(members[node], **changes)
        self.run = replace(self.run, members=tuple(members))
        return members[node]

    def set_job(self, state: JobState, reason: str) -> None:
        self.emit(SetJobState(state, reason))
        self.run = replace(self.run, job_state=state, reason=reason)

    def set_member(
        self, node: int, state: MemberState, exit_code: int | None = None, signal: str | None = None
    ) -> None:
        """Move a live member, through the forward states it skipped; a terminal one stays."""
        current = self.run.members[node].state
        if current.is_terminal or current is state:
            return
        if state in _FORWARD:
            here, there = _FORWARD.index(current), _FORWARD.index(state)
            if there < here:
                return
            for between in _FORWARD[here + 1 : there]:
                self.emit(SetMemberState(node, between))
        self.emit(SetMemberState(node, state, exit_code, signal))
        self.update(node, state=state)

    def release(self, node: int) -> None:
        member = self.run.members[node]
        if not member.released:
            self.emit(ReleaseWorker(member.worker))
            self.update(node, released=True)


def with_everyone(run: GangRun, node: int) -> list[tuple[int, int]]:
    return [(node, m.node) for m in run.members if m.node != node]


def fence(
    turn: Turn,
    cause: str,
    pairs: list[tuple[int, int]],
    reason: str,
    *,
    network: bool = True,
    mtu: int | None = None,
) -> None:
    """This epoch's network failed before any rank started: fence the epoch (every device
    and probe endpoint comes down, the workers go back) and queue the job again, with the
    failed pairs kept apart on this path, or (``mtu``) its direct gangs' packets made that
    small. Not billed: nothing of the user's ran. After MAX_NETWORK_EPOCHS such epochs (and
    the run's spare ones: an epoch fenced for its packets' size alone is not counted), or
    once a member was assigned, the job fails."""
    run = turn.run
    if run.is_over:
        return
    # Pairs the probe found wanting in this round, whatever fences the epoch now (a member
    # lost while the round measured, its deadline): none of what they showed is lost.
    # (Not a pair with a member lost since: its stall was that outage, not packet size, and
    # its worker is offline. The causes the job cannot outlive are named first.)
    failed = sorted(
        (f for f in run.probe_failed if not any(run.members[n].lost for n in f.pair)),
        key=lambda f: f.smaller,
    )
    if failed:
        pairs = [*pairs, *(f.pair for f in failed if not f.smaller)]
        if mtu is None and any(f.smaller for f in failed):
            mtu = MESH_MTU
        if failed[0].cause not in cause:
            cause += f"; {failed[0].cause}"
        if len(failed) > 1:
            others = len(failed) - 1
            cause += f"; and {others} more pair{'s' if others > 1 else ''} of the round failed"
    path = run.path or PathClass.PRIVATE
    if network:  # (not for a lost member or a restart: the network was not found wanting)
        turn.emit(SetCondition("NetworkQualified", False, reason, cause))
    # An epoch fenced for its packets' size alone is not counted: the job's next gangs get
    # a spare epoch (Placed.spare_epochs), and so does this one if it has none yet.
    alone = network and mtu is not None and not pairs and run.spare_epochs == 0
    budget = MAX_NETWORK_EPOCHS + run.spare_epochs + (1 if alone else 0)
    if run.epoch >= budget or any(m.assigned for m in run.members):
        fail(turn, JobState.FAILED, f"{cause} (epoch {run.epoch}; not placed again)")
        return
    kept = sorted(
        {
            tuple(sorted((run.members[a].worker, run.members[b].worker)))
            for a, b in pairs
            if a != b and turn.member(a) is not None and turn.member(b) is not None
        }
    )
    again = f"epoch {run.epoch} fenced: {cause}; placing the gang again"
    if kept:
        shown = ", ".join(f"{a} and {b}" for a, b in kept[:4])
        more = f" (and {len(kept) - 4} more pairs)" if len(kept) > 4 else ""
        again += f", keeping {shown}{more} apart on the {path.value} path"
        turn.emit(KeepApart(path, tuple((a, b) for a, b in kept)))
    data: dict[str, object] = {
        "epoch": run.epoch,
        "path": path.value,
        "reason": reason,
        "apart": [[a, b] for a, b in kept],
    }
    if mtu is not None:  # (the event is what a restarted controller places by)
        again += f" with MTU {mtu} (a --direct-mtu {mtu} on these hosts' agents says it at once)"
        data["mtu"] = mtu
        turn.emit(SmallerPackets(mtu))
    turn.emit(
        SetCondition("GangReady", False, reason, again),
        RecordEvent("EpochFenced", again, data),
    )
    stop_members(turn, cause)
    turn.set_job(JobState.QUEUED, again)
    turn.run = replace(turn.run, fenced=True)


def fail(turn: Turn, state: JobState, cause: str) -> None:
    """Fail (or cancel) the job: STOP to members that may run, never-started ones cancelled."""
    if turn.run.is_over:
        return
    turn.set_job(state, cause)
    stop_members(turn, cause)


def stop_members(turn: Turn, cause: str) -> None:
    for member in turn.run.members:
        if member.gone:
            continue
        if not member.assigned:
            turn.set_member(member.node, MemberState.CANCELLED)
            turn.release(member.node)
            if member.networked or member.probing or member.holding:
                # Its device, its probe endpoint or the rendezvous port node 0 holds comes
                # down (the agent answers "absent").
                turn.emit(SendStop(member.worker, cause))
            continue
        if not member.started:
            turn.set_member(member.node, MemberState.CANCELLED)
        turn.emit(SendStop(member.worker, cause))
