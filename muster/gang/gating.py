"""The gate before the start: node 0 publishes its rendezvous address, every member checks
that it reaches node 0 and runs a matching torch (MASTER_CHECK), then ASSIGN, node 0 first."""

from __future__ import annotations

from muster.gang.actions import RecordEvent, SendAssign, SendMasterCheck, SetRendezvous
from muster.gang.events import MasterChecked, PortPublished
from muster.gang.run import Member, replace
from muster.gang.turn import MASTER_CHECK_BUDGET_S, Turn, fail, fence
from muster.spec import JobState, MemberState


def port_published(turn: Turn, event: PortPublished) -> None:
    """Node 0 holds its rendezvous port open: in a gang across nodes every member dials it
    and says its versions first (MASTER_CHECK), so a port no member reaches, or a member on
    another torch, fails the epoch before any rank starts; alone, node 0 goes on at once."""
    run = turn.run
    if (
        event.node != 0
        or run.published is not None
        or run.checking is not None
        or run.job_state is not JobState.RENDEZVOUS
    ):
        return
    if len(run.members) == 1:
        _publish(turn, event.addr, event.port)
        return
    turn.run = replace(run, checking=(event.addr, event.port))
    maybe_check(turn)


def maybe_check(turn: Turn) -> None:
    """MASTER_CHECK to every member, once node 0 holds its port and every member is here."""
    run = turn.run
    if (
        run.checking is None
        or run.check_sent
        or run.published is not None
        or run.job_state is not JobState.RENDEZVOUS
        or any(m.unconfirmed for m in run.members)
    ):
        return
    addr, port = run.checking
    turn.run = replace(run, check_sent=True, rendezvous_deadline=turn.now + MASTER_CHECK_BUDGET_S)
    turn.emit(
        RecordEvent(
            "RendezvousCheck",
            f"epoch {run.epoch}: every member dials node0's rendezvous at "
            f"{_host_port(addr, port)} before any rank starts",
            {"addr": addr, "port": port},
        )
    )
    for member in run.members:
        turn.emit(
            SendMasterCheck(member.node, member.worker, None if member.node == 0 else addr, port)
        )


def master_checked(turn: Turn, event: MasterChecked) -> None:
    member = turn.member(event.node)
    run = turn.run
    if (
        member is None
        or run.checking is None
        or run.published is not None
        or run.job_state is not JobState.RENDEZVOUS
        or member.checked is not None
    ):
        return
    addr, port = run.checking
    if event.error is not None and member.node != 0:
        node0 = run.members[0]
        cause = (
            f"node{member.node} (worker {member.worker}) cannot reach node0's rendezvous at "
            f"{_host_port(addr, port)} (worker {node0.worker}): {event.error}; let TCP port "
            f"{port} of node0 in from the gang's members, or advertise an address they route "
            "to (`muster agent --interface`)"
        )
        fence(turn, cause, [(0, member.node)], "MasterUnreachable")
        return
    turn.update(member.node, checked=(event.torch, event.nccl))
    if any(m.checked is None for m in turn.run.members):
        return
    mismatch = version_mismatch(turn.run.members)
    if mismatch is not None:
        fail(turn, JobState.FAILED, mismatch)
        return
    turn.run = replace(turn.run, checking=None)
    _publish(turn, addr, port)


def version_mismatch(members: tuple[Member, ...]) -> str | None:
    """Why these members cannot run one job together (torch, then NCCL, differ), naming the
    odd ones against the version most members run; None when they agree (or do not know)."""
    for index, name in ((0, "torch"), (1, "NCCL")):
        seen: dict[int, str] = {}
        for m in members:
            version = m.checked[index] if m.checked else None
            if version:
                seen[m.node] = version
        versions = sorted(set(seen.values()))
        if len(versions) < 2:
            continue
        counts = {v: sum(1 for x in seen.values() if x == v) for v in versions}
        common = max(versions, key=lambda v: (counts[v], v == seen.get(0)))
        odd = ", ".join(
            f"node{m.node} (worker {m.worker}) runs {name} {seen[m.node]}"
            for m in members
            if m.node in seen and seen[m.node] != common
        )
        fix = (
            f"install torch=={common} in every member's Python (`muster agent --python`)"
            if name == "torch"
            else "install one torch build on every member (its NCCL comes with it)"
        )
        return f"the members' {name} differs: {odd}, the others {name} {common}: {fix}"
    return None


def _host_port(addr: str, port: int) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def _publish(turn: Turn, addr: str, port: int) -> None:
    turn.run = replace(turn.run, published=(addr, port))
    turn.emit(
        SetRendezvous(addr, port),
        RecordEvent(
            "RendezvousPublished",
            f"node0 published {_host_port(addr, port)}",
            {"addr": addr, "port": port},
        ),
    )
    maybe_assign(turn)


def maybe_assign(turn: Turn) -> None:
    """ASSIGN every unassigned member, node 0 first, once the port is out and all are here."""
    run = turn.run
    if (
        run.published is None
        or run.job_state is not JobState.RENDEZVOUS
        or any(m.unconfirmed for m in run.members)
    ):
        return
    for member in run.members:
        if member.assigned:
            continue
        turn.emit(SendAssign(member.node, member.worker))
        turn.set_member(member.node, MemberState.ASSIGNED)
        turn.update(member.node, assigned=True)
        turn.emit(
            RecordEvent(
                "Assigned",
                f"node{member.node} (worker {member.worker}) assigned",
                {"node": member.node, "worker": member.worker},
            )
        )
