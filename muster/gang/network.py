"""A gang's network before its command starts: the direct and relayed paths' set-up once
``lifecycle`` sent NET_SETUP (NET_READY, NET_PEERS, NET_UP), the probe in rounds of disjoint
pairs, the rendezvous once the path is proven, and a running pair that loses its path
(NetworkDegraded)."""

from __future__ import annotations

from muster.gang.actions import (
    RecordEvent,
    SendNetPeers,
    SendPrepareRendezvous,
    SendProbeListen,
    SendProbeRun,
    SetCondition,
)
from muster.gang.events import NetPath, NetReady, NetUp, ProbeDone, ProbePair, ProbeReady
from muster.gang.run import GangRun, Member, ProbeFailure, replace
from muster.gang.turn import RENDEZVOUS_TIMEOUT_S, Turn, fail, fence, with_everyone
from muster.plan import MESH_MTU
from muster.spec import JobState, PathClass

# A probed pair's connects (up to 25 s when they time out: muster.net.probe's readiness
# window) and echo, beyond its throughput sample.
PROBE_PAIR_SLACK_S = 30.0


def start_probe_or_rendezvous(turn: Turn) -> None:
    """Probe every pair first when this run probes; else straight to the rendezvous."""
    run = turn.run
    if run.probe_seconds is None:
        _start_rendezvous(turn)
        return
    path = run.path.value if run.path else "private"
    turn.run = replace(run, rendezvous_deadline=turn.now + probe_budget(run))
    if run.job_state is not JobState.NETWORKING:
        turn.set_job(
            JobState.NETWORKING,
            f"epoch {run.epoch}: probing the {path} path between {len(run.members)} members",
        )
    for member in turn.run.members:
        turn.emit(SendProbeListen(member.node, member.worker))
        turn.update(member.node, probing=True)


def probe_rounds(n: int) -> list[list[tuple[int, int]]]:
    """Every pair of n nodes once, in rounds of disjoint pairs (the circle method): no node
    is in two measurements at once, so no pair shares its links with another of its round
    beyond what the network itself shares."""
    nodes: list[int | None] = list(range(n)) + ([None] if n % 2 else [])
    rounds = []
    for _ in range(len(nodes) - 1):
        pairs = []
        for i in range(len(nodes) // 2):
            a, b = nodes[i], nodes[-1 - i]
            if a is not None and b is not None:
                pairs.append((min(a, b), max(a, b)))
        rounds.append(sorted(pairs))
        nodes = [nodes[0], nodes[-1], *nodes[1:-1]]
    return rounds


def probe_budget(run: GangRun) -> float:
    """How long a run's probe may take: one pair's measurement per round."""
    per_pair = (run.probe_seconds or 0.0) + PROBE_PAIR_SLACK_S
    return RENDEZVOUS_TIMEOUT_S + per_pair * len(probe_rounds(len(run.members)))


def probe_ready(turn: Turn, event: ProbeReady) -> None:
    member = turn.member(event.node)
    run = turn.run
    if (
        member is None
        or run.job_state is not JobState.NETWORKING
        or run.probe_seconds is None
        or member.probe_port is not None
    ):
        return
    if event.error is not None or not 0 < event.port < 65536:
        why = event.error or f"port {event.port}"
        cause = f"node{member.node} (worker {member.worker}) could not open its probe endpoint"
        fence(turn, f"{cause}: {why}", with_everyone(run, member.node), "ProbeFailed")
        return
    turn.update(member.node, probe_port=event.port)
    if all(m.probe_port is not None for m in turn.run.members):
        _next_probe_round(turn)


def _next_probe_round(turn: Turn) -> None:
    """Send the next round's measurements, or, after the last, report and rendezvous."""
    run = turn.run
    rounds = probe_rounds(len(run.members))
    index = run.probe_round + 1
    if index >= len(rounds):
        _probe_passed(turn)
        return
    pending = frozenset(a for a, _b in rounds[index])
    turn.run = replace(run, probe_round=index, probe_pending=pending)
    for a, b in rounds[index]:
        member, peer = run.members[a], run.members[b]
        turn.emit(
            SendProbeRun(a, member.worker, ((b, peer.probe_port or 0),), run.probe_seconds or 0.0)
        )


def probe_done(turn: Turn, event: ProbeDone) -> None:
    member = turn.member(event.node)
    run = turn.run
    if (
        member is None
        or run.job_state is not JobState.NETWORKING
        or member.node not in run.probe_pending
    ):
        return
    rounds = probe_rounds(len(run.members))
    expected = [b for a, b in rounds[run.probe_round] if a == member.node]
    reported = [pair.node for pair in event.pairs]
    if reported != expected:
        cause = (
            f"node{member.node} (worker {member.worker}) reported a probe of nodes "
            f"{sorted(reported)}, not of {expected}"
        ) + "".join(f"; {f.cause}" for f in run.probe_failed)
        fail(turn, JobState.FAILED, cause)
        return
    turn.update(member.node, probed=(*(member.probed or ()), *event.pairs))
    failed = [*run.probe_failed, *_failures(run, member, event)]
    pending = turn.run.probe_pending - {member.node}
    turn.run = replace(turn.run, probe_pending=pending, probe_failed=tuple(failed))
    if pending:
        return  # the round's other pairs are still measuring
    if failed:
        _fence_failed(turn, failed)
    else:
        _next_probe_round(turn)


def _failures(run: GangRun, member: Member, event: ProbeDone) -> list[ProbeFailure]:
    found = []
    for pair in event.pairs:
        peer = run.members[pair.node]
        who = (
            f"node{member.node} (worker {member.worker}) to node{pair.node} (worker {peer.worker})"
        )
        nodes = (member.node, pair.node)
        if pair.error is not None or pair.connects < 3:
            cause = f"the probe failed from {who}: {pair.error}"
            if run.path is PathClass.DIRECT and pair.connects >= 3 and _above(member, peer):
                # Connected, then stalled, with packets larger than any network is sure to
                # carry: the next epoch tries 1280 before the pair is kept apart.
                cause += f" (their devices' MTU: {member.mtu or '?'} and {peer.mtu or '?'})"
                found.append(ProbeFailure(cause, nodes, "ProbeFailed", smaller=True))
            else:
                found.append(ProbeFailure(cause, nodes, "ProbeFailed"))
        elif run.path is PathClass.DIRECT and pair.via is not None and pair.via != event.device:
            # Read from the data plane: the pair's traffic did not take the gang's network.
            cause = (
                f"the probe's traffic from {who} left by {pair.via}, not {event.device}: "
                "not the direct path"
            )
            found.append(ProbeFailure(cause, nodes, "PathNotDirect"))
    return found


def _fence_failed(turn: Turn, failed: list[ProbeFailure]) -> None:
    """Fence the epoch for every pair of the round that failed: each kept apart, except
    those that stalled above 1280 (the next epoch tries smaller packets first)."""
    first = min(failed, key=lambda f: f.smaller)  # (as fence names them: the job's own first)
    fence(turn, first.cause, [], first.reason)  # (fence adds the round's failures)


def _above(a: Member, b: Member) -> bool:
    """Either device of the pair is above the 1280 that crosses any network: a path that
    carries less than its links say (PPPoE, a tunnel underneath), dropping the ICMP that
    would tell, passes a handshake and connections, and stalls a transfer."""
    return any(m.mtu and m.mtu > MESH_MTU for m in (a, b))


def _probe_passed(turn: Turn) -> None:
    run = turn.run
    pairs = sorted(
        ((m.node, p) for m in run.members for p in (m.probed or ()) if isinstance(p, ProbePair)),
        key=lambda item: (item[0], item[1].node),
    )
    path = run.path.value if run.path else "private"
    rated = [(p.gbps, a, p) for a, p in pairs if p.gbps is not None]
    if rated:
        _gbps, a, slowest = min(rated, key=lambda item: item[0])
    elif pairs:
        a, slowest = max(pairs, key=lambda item: item[1].rtt_ms or 0.0)
    else:  # unreachable: a gang that probes has 2+ members
        _start_rendezvous(turn)
        return
    summary = (
        f"slowest pair node{a}-node{slowest.node}: "
        + (f"{slowest.gbps:.2f} Gbit/s, " if slowest.gbps is not None else "")
        + f"RTT {slowest.rtt_ms} ms on the {path} path ({len(pairs)} pairs)"
    )
    turn.emit(
        SetCondition("NetworkQualified", True, "ProbePassed", summary),
        RecordEvent(
            "Probe",
            summary,
            {
                "epoch": run.epoch,
                "path": path,
                "seconds": run.probe_seconds,
                "slowest": {
                    "a": a,
                    "b": slowest.node,
                    "tcpGbps": slowest.gbps,
                    "rttMs": slowest.rtt_ms,
                },
                "pairs": [
                    {
                        "a": a,
                        "b": p.node,
                        "tcpGbps": p.gbps,
                        "rttMs": p.rtt_ms,
                        "via": p.via,
                        "endpoint": p.endpoint,
                    }
                    for a, p in pairs
                ],
            },
        ),
    )
    _start_rendezvous(turn)


def _start_rendezvous(turn: Turn) -> None:
    turn.run = replace(turn.run, rendezvous_deadline=turn.now + RENDEZVOUS_TIMEOUT_S)
    run = turn.run
    if len(run.members) > 1 and run.job_state is JobState.NETWORKING:
        path = run.path.value if run.path else "private"
        turn.emit(
            SetCondition(
                "GangReady",
                True,
                "NetworkReady",
                f"epoch {run.epoch}: {len(run.members)} members on the {path} path",
            )
        )
    why = f"epoch {run.epoch}: waiting for node0 to publish its address"
    turn.set_job(JobState.RENDEZVOUS, why)
    turn.emit(SendPrepareRendezvous(run.members[0].worker, run.master_addr, run.port))
    turn.update(0, holding=True)


def net_ready(turn: Turn, event: NetReady) -> None:
    member = turn.member(event.node)
    if member is None or turn.run.job_state is not JobState.NETWORKING:
        return
    if member.net_key and event.error is None:
        return  # a repeated NET_READY
    path = turn.run.path or PathClass.DIRECT
    who = f"node{member.node} (worker {member.worker})"
    if event.shim_not_loaded:
        # Placing the gang again would not help: the job's own launcher ignores LD_PRELOAD.
        turn.emit(SetCondition("GangReady", False, "ShimNotLoaded", f"{who}: {event.error}"))
        fail(turn, JobState.FAILED, f"ShimNotLoaded: {who}: {event.error}")
        return
    needs_endpoint = path is PathClass.DIRECT
    if event.error is not None or not event.public_key or (needs_endpoint and not event.endpoint):
        why = event.error or "its NET_READY carried no key or endpoint"
        silent = [n for n in event.silent if n != member.node and turn.member(n) is not None]
        fence(
            turn,
            f"{who} could not set up the {path.value} path: {why}",
            [(member.node, n) for n in silent] or with_everyone(turn.run, member.node),
            "DirectPathFailed" if path is PathClass.DIRECT else "RelayedPathFailed",
        )
        return
    turn.update(member.node, net_key=(event.public_key, event.endpoint), mtu=event.mtu)
    members = turn.run.members
    if any(m.net_key is None for m in members):
        return
    for m in members:
        peers = tuple(
            (other.node, other.net_key[0], other.net_key[1])
            for other in members
            if other.node != m.node and other.net_key is not None
        )
        turn.emit(SendNetPeers(m.node, m.worker, peers))


def net_up(turn: Turn, event: NetUp) -> None:
    member = turn.member(event.node)
    run = turn.run
    if (
        member is None
        or run.job_state is not JobState.NETWORKING
        or member.net_key is None
        or member.net_up
    ):
        return  # (a repeated NET_UP must not start the probe again)
    turn.update(member.node, net_up=True)
    if all(m.net_up for m in turn.run.members):
        path = (run.path or PathClass.DIRECT).value
        said = f"epoch {run.epoch}: {path} network up between {len(run.members)} members"
        data: dict[str, object] = {"epoch": run.epoch, "path": path}
        mtus = [m.mtu for m in turn.run.members]
        if any(mtus):  # (each member's device, node by node: one that lacks it is a suspect)
            said += " (MTU " + ", ".join(str(m or "?") for m in mtus) + ")"
            data["mtu"] = mtus
        turn.emit(RecordEvent("NetworkReady", said, data))
        start_probe_or_rendezvous(turn)


def net_path(turn: Turn, event: NetPath) -> None:
    """A running member's view of its direct paths: NetworkDegraded follows the gang's."""
    member = turn.member(event.node)
    run = turn.run
    if member is None or run.is_over or run.path is not PathClass.DIRECT or not member.assigned:
        return
    lost = tuple(sorted({n for n in event.lost if n != member.node and turn.member(n)}))
    if lost == member.lost_peers and run.degraded is not None:
        return
    turn.update(member.node, lost_peers=lost)
    degraded(turn, member.node)


def degraded(turn: Turn, node: int) -> None:
    """Set NetworkDegraded from the members' lost peers, when the gang's answer changes. A
    member that is gone (its device went with it) is neither silent nor missed."""
    run = turn.run
    gone = {m.node for m in run.members if m.gone}
    silent = [
        (m, [n for n in m.lost_peers if n not in gone])
        for m in run.members
        if not m.gone and any(n not in gone for n in m.lost_peers)
    ]
    if silent:
        message = f"epoch {run.epoch}: " + "; ".join(
            f"node{m.node} (worker {m.worker}) hears nothing from "
            + ", ".join(f"node{n}" for n in peers)
            for m, peers in silent
        )
        turn.emit(
            SetCondition("NetworkDegraded", True, "DirectPathLost", message),
            RecordEvent("NetworkDegraded", message, {"epoch": run.epoch, "node": node}),
        )
        turn.run = replace(turn.run, degraded=True)
    elif run.degraded is not False:  # True, or unknown after a restart
        message = f"epoch {run.epoch}: every pair hears each other again"
        turn.emit(SetCondition("NetworkDegraded", False, "DirectPathRestored", message))
        if run.degraded:
            turn.emit(RecordEvent("NetworkRestored", message, {"epoch": run.epoch, "node": node}))
        turn.run = replace(turn.run, degraded=False)
