"""One gang run's lifecycle: ``step(run, event, now) -> (run, actions)``, pure (seed 001).

The controller feeds every frame, link change, tick and API call for a run through ``step``
and applies the returned actions in order; the rules live here alone::

    unplaced ─Placed─► rendezvous ─PortPublished(node 0)─► starting ─all started─► running
                           │                                   │                     │   │
                           ├───────────────────────────────────┴─────────────────────┘   │
                           ├─ first member to exit non-zero, be lost, outlive the        │
                           │  timeout, fail its upload, or miss a restart's grace ─► failed
                           └─ Cancel ────────────────────────────────────────────► cancelled
                              every member exited 0 and its outputs stored ─► succeeded ◄┘

    Placed:         SetJobState(rendezvous), PREPARE_RENDEZVOUS to node 0; on the direct
                    path first SetJobState(networking) and NET_SETUP to every member, then
                    NET_PEERS once every key is in, and the rendezvous once every NET_UP is
    PortPublished:  SetRendezvous, then ASSIGN + SetMemberState(assigned), node 0 first
                    (held back while a member is unconfirmed after a restart)
    MemberStarted:  SetMemberState(starting, running); the last one: SetJobState(running)
    MemberExited:   SetMemberState(succeeded | failed), ReleaseWorker

Failing (or cancelling) the job sends STOP to every member that may be running and cancels
the ones never started. A worker is released only when its member's processes are known
gone (its exit, or its agent dialled back without it) or were never started. Once the job
is terminal no event changes its state; exits still arrive and release their workers, and
a member still alive when its agent dials back is told to STOP again.
"""

from __future__ import annotations

from typing import Any

from muster.gang.actions import (
    Action,
    CaptureStacks,
    KeepApart,
    RecordEvent,
    ReleaseWorker,
    SendAssign,
    SendMasterCheck,
    SendNetPeers,
    SendNetSetup,
    SendPrepareRendezvous,
    SendProbeListen,
    SendProbeRun,
    SendStop,
    SetCondition,
    SetJobState,
    SetMemberState,
    SetRendezvous,
    SmallerPackets,
)
from muster.gang.causes import root_cause, upload_cause
from muster.gang.events import (
    Cancel,
    ControllerRestarted,
    Event,
    LinkBack,
    LinkLost,
    MasterChecked,
    MemberExited,
    MemberHung,
    MemberStarted,
    NetPath,
    NetReady,
    NetUp,
    OutputsStored,
    Placed,
    PortPublished,
    ProbeDone,
    ProbePair,
    ProbeReady,
    StacksCaptured,
    Tick,
)
from muster.gang.run import GangPhase, GangRun, Member, replace
from muster.plan import MESH_MTU
from muster.spec import JobState, MemberState, PathClass

_M = MemberState
_FORWARD = (_M.PENDING, _M.ASSIGNED, _M.STARTING, _M.RUNNING, _M.SUCCEEDED)
_BEFORE_RENDEZVOUS = (JobState.PLACING, JobState.NETWORKING)
_BUILT_PATHS = (PathClass.DIRECT, PathClass.RELAYED)  # the paths muster sets up per epoch
RENDEZVOUS_TIMEOUT_S = 120.0  # node 0 answers PREPARE_RENDEZVOUS within this, or the job fails
# Every member answers MASTER_CHECK within this (its agent dials for 10 s at most and reads
# the versions in its Python meanwhile), or the epoch is fenced.
MASTER_CHECK_BUDGET_S = 30.0
# A probed pair's connects (up to 25 s when they time out: muster.net.probe's readiness
# window) and echo, beyond its throughput sample.
PROBE_PAIR_SLACK_S = 30.0
# A gang whose network fails before its command starts is placed again (a new epoch, its
# failed pairs kept apart); in this epoch, it fails instead.
MAX_NETWORK_EPOCHS = 3


def step(run: GangRun, event: Event, now: float) -> tuple[GangRun, tuple[Action, ...]]:
    """Apply one event to the run; ``now`` is the controller's clock (seconds)."""
    turn = _Turn(run, now)
    if isinstance(event, Placed):
        _placed(turn, event)
    elif not run.members:
        pass  # nothing but Placed means anything before the gang exists
    elif isinstance(event, NetReady):
        _net_ready(turn, event)
    elif isinstance(event, NetUp):
        _net_up(turn, event)
    elif isinstance(event, ProbeReady):
        _probe_ready(turn, event)
    elif isinstance(event, ProbeDone):
        _probe_done(turn, event)
    elif isinstance(event, NetPath):
        _net_path(turn, event)
    elif isinstance(event, MemberHung):
        _member_hung(turn, event)
    elif isinstance(event, StacksCaptured):
        _fail_hung(turn, event.episode)
    elif isinstance(event, PortPublished):
        _port_published(turn, event)
    elif isinstance(event, MasterChecked):
        _master_checked(turn, event)
    elif isinstance(event, MemberStarted):
        _member_started(turn, event)
    elif isinstance(event, MemberExited):
        _member_exited(turn, event)
    elif isinstance(event, OutputsStored):
        _outputs_stored(turn, event)
    elif isinstance(event, LinkLost):
        _link_lost(turn, event)
    elif isinstance(event, LinkBack):
        _link_back(turn, event)
    elif isinstance(event, Tick):
        _tick(turn)
    elif isinstance(event, Cancel):
        if not run.is_over:
            _fail(turn, JobState.CANCELLED, event.reason)
    elif isinstance(event, ControllerRestarted):
        _restarted(turn, event)
    if turn.run.hang_timeout is not None:
        _hung(turn)  # a member that started, ended or came back changes who is silent
    return turn.run, tuple(turn.actions)


class _Turn:
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


# ---- placement and gating ----------------------------------------------------------------


def _placed(turn: _Turn, event: Placed) -> None:
    if turn.run.members:
        return  # one placement per run: a new epoch is a new run
    run = GangRun.placed(event.job, event.epoch, event.workers, event.path)
    turn.run = replace(
        run,
        master_addr=event.master_addr,
        port=event.port,
        timeout=event.timeout,
        deadline=turn.now + event.timeout if event.timeout else None,
        rendezvous_deadline=turn.now + RENDEZVOUS_TIMEOUT_S,
        probe_seconds=event.probe_seconds if len(event.workers) > 1 else None,
        fail_on_hang=event.fail_on_hang,
        hang_timeout=event.hang_timeout,
    )
    if event.path in _BUILT_PATHS and len(event.workers) > 1:
        # The gang's own network first: every member makes a key (and on the direct path a
        # device); the keys go round once all are in; the rendezvous starts once every
        # member has its peers (its device's handshakes, or its links to the relays).
        turn.set_job(
            JobState.NETWORKING,
            f"epoch {event.epoch}: setting up the {event.path.value} network between "
            f"{len(event.workers)} members",
        )
        for member in turn.run.members:
            turn.emit(SendNetSetup(member.node, member.worker))
            turn.update(member.node, networked=True)
        return
    _start_probe_or_rendezvous(turn)


def _start_probe_or_rendezvous(turn: _Turn) -> None:
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


def _probe_ready(turn: _Turn, event: ProbeReady) -> None:
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
        _fence(turn, f"{cause}: {why}", _with_everyone(run, member.node), "ProbeFailed")
        return
    turn.update(member.node, probe_port=event.port)
    if all(m.probe_port is not None for m in turn.run.members):
        _next_probe_round(turn)


def _next_probe_round(turn: _Turn) -> None:
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


def _probe_done(turn: _Turn, event: ProbeDone) -> None:
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
        )
        _fail(turn, JobState.FAILED, cause)
        return
    turn.update(member.node, probed=(*(member.probed or ()), *event.pairs))
    turn.run = replace(turn.run, probe_pending=turn.run.probe_pending - {member.node})
    for pair in event.pairs:
        peer = run.members[pair.node]
        who = (
            f"node{member.node} (worker {member.worker}) to node{pair.node} (worker {peer.worker})"
        )
        if pair.error is not None or pair.connects < 3:
            cause = f"the probe failed from {who}: {pair.error}"
            if run.path is PathClass.DIRECT and pair.connects >= 3 and _above(member, peer):
                # Connected, then stalled, with packets larger than any network is sure to
                # carry: the next epoch tries 1280 before the pair is kept apart.
                cause += f" (their devices' MTU: {member.mtu or '?'} and {peer.mtu or '?'})"
                _fence(turn, cause, [], "ProbeFailed", mtu=MESH_MTU)
                return
            _fence(turn, cause, [(member.node, pair.node)], "ProbeFailed")
            return
        if run.path is PathClass.DIRECT and pair.via is not None and pair.via != event.device:
            # Read from the data plane: the pair's traffic did not take the gang's network.
            cause = (
                f"the probe's traffic from {who} left by {pair.via}, not {event.device}: "
                "not the direct path"
            )
            _fence(turn, cause, [(member.node, pair.node)], "PathNotDirect")
            return
    if not turn.run.probe_pending:
        _next_probe_round(turn)


def _above(a: Member, b: Member) -> bool:
    """Either device of the pair is above the 1280 that crosses any network: a path that
    carries less than its links say (PPPoE, a tunnel underneath), dropping the ICMP that
    would tell, passes a handshake and connections, and stalls a transfer."""
    return any(m.mtu and m.mtu > MESH_MTU for m in (a, b))


def _probe_passed(turn: _Turn) -> None:
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


def _start_rendezvous(turn: _Turn) -> None:
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


def _net_ready(turn: _Turn, event: NetReady) -> None:
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
        _fail(turn, JobState.FAILED, f"ShimNotLoaded: {who}: {event.error}")
        return
    needs_endpoint = path is PathClass.DIRECT
    if event.error is not None or not event.public_key or (needs_endpoint and not event.endpoint):
        why = event.error or "its NET_READY carried no key or endpoint"
        silent = [n for n in event.silent if n != member.node and turn.member(n) is not None]
        _fence(
            turn,
            f"{who} could not set up the {path.value} path: {why}",
            [(member.node, n) for n in silent] or _with_everyone(turn.run, member.node),
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


def _net_up(turn: _Turn, event: NetUp) -> None:
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
        _start_probe_or_rendezvous(turn)


def _net_path(turn: _Turn, event: NetPath) -> None:
    """A running member's view of its direct paths: NetworkDegraded follows the gang's."""
    member = turn.member(event.node)
    run = turn.run
    if member is None or run.is_over or run.path is not PathClass.DIRECT or not member.assigned:
        return
    lost = tuple(sorted({n for n in event.lost if n != member.node and turn.member(n)}))
    if lost == member.lost_peers and run.degraded is not None:
        return
    turn.update(member.node, lost_peers=lost)
    _degraded(turn, member.node)


HANG_STACKS_WAIT_S = 30.0  # on_hang "fail" waits this long at most for the stacks
HANG_FIX = (
    "fix: the stacks in the job's events (HungStacks; `muster stacks JOB` while it runs) show "
    "where each rank waits: most often all but one wait in a collective for the one that "
    "did not reach it"
)


def _member_hung(turn: _Turn, event: MemberHung) -> None:
    """HUNG from a member (its own, of this epoch: the controller maps it). Whether the job
    is Hung is decided after every event, in ``_hung``."""
    member = turn.member(event.node)
    if member is None or turn.run.is_over or not member.started or member.gone:
        return
    if member.hung != event.hung or member.ranks != event.ranks:
        turn.update(member.node, hung=event.hung, ranks=event.ranks)


def _hung(turn: _Turn) -> None:
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


def _fail_hung(turn: _Turn, episode: int | None = None) -> None:
    """on_hang "fail": the job ends failed once this episode's stacks are in, or their wait
    is over (``episode`` None: the clock)."""
    run = turn.run
    if run.hang_fail_at is None or run.is_over:
        return
    if episode is not None and episode != run.hang_episode:
        return  # a capture of an earlier episode
    _fail(turn, JobState.FAILED, f"hung: {run.hang_message}\n{HANG_FIX}")


def _degraded(turn: _Turn, node: int) -> None:
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


def _port_published(turn: _Turn, event: PortPublished) -> None:
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
    _maybe_check(turn)


def _maybe_check(turn: _Turn) -> None:
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


def _master_checked(turn: _Turn, event: MasterChecked) -> None:
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
        _fence(turn, cause, [(0, member.node)], "MasterUnreachable")
        return
    turn.update(member.node, checked=(event.torch, event.nccl))
    if any(m.checked is None for m in turn.run.members):
        return
    mismatch = version_mismatch(turn.run.members)
    if mismatch is not None:
        _fail(turn, JobState.FAILED, mismatch)
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


def _publish(turn: _Turn, addr: str, port: int) -> None:
    turn.run = replace(turn.run, published=(addr, port))
    turn.emit(
        SetRendezvous(addr, port),
        RecordEvent(
            "RendezvousPublished",
            f"node0 published {_host_port(addr, port)}",
            {"addr": addr, "port": port},
        ),
    )
    _maybe_assign(turn)


def _maybe_assign(turn: _Turn) -> None:
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


# ---- members -----------------------------------------------------------------------------


def _member_started(turn: _Turn, event: MemberStarted) -> None:
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
    _maybe_running(turn)


def _maybe_running(turn: _Turn) -> None:
    run = turn.run
    if (
        run.job_state is JobState.RENDEZVOUS
        and run.published is not None
        and all(m.started for m in run.members)
    ):
        turn.set_job(JobState.RUNNING, f"all {len(run.members)} nodes started")


def _member_exited(turn: _Turn, event: MemberExited) -> None:
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
            _fail(turn, JobState.FAILED, f"{cause} (preparing the rendezvous)")
        return
    node, code, over = member.node, event.exit_code, turn.run.is_over
    if code == 0 and not member.started and not over:
        turn.update(node, started=True)
        turn.set_member(node, MemberState.RUNNING)
        _maybe_running(turn)
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
        _fail(turn, JobState.FAILED, cause)
    else:
        if turn.run.degraded and not turn.run.is_over:
            _degraded(turn, node)  # its device went with it: nobody misses it any more
        _maybe_succeed(turn)


def _outputs_stored(turn: _Turn, event: OutputsStored) -> None:
    member = turn.member(event.node)
    if member is None or not member.assigned or member.outputs is not None:
        return
    turn.update(member.node, outputs=event.ok)
    if event.ok:
        _maybe_succeed(turn)
        return
    cause = upload_cause(member.node, member.worker, event.errors)
    if not turn.run.is_over:
        _fail(turn, JobState.FAILED, cause)
    else:
        turn.emit(
            RecordEvent("OutputsFailed", cause, {"node": member.node, "errors": list(event.errors)})
        )


def _maybe_succeed(turn: _Turn) -> None:
    run = turn.run
    if run.job_state is JobState.RUNNING and all(
        m.exit_code == 0 and m.outputs is True for m in run.members
    ):
        turn.set_job(JobState.SUCCEEDED, f"all {len(run.members)} nodes exited 0")


# ---- links, clock, restart ---------------------------------------------------------------


def _awaits_outputs(member: Member) -> bool:
    return member.exit_code == 0 and member.outputs is None


def _link_lost(turn: _Turn, event: LinkLost) -> None:
    node = turn.run.node_of(event.worker)
    if node is None or turn.run.members[node].lost:
        return
    member = turn.update(node, lost=True)
    over = turn.run.is_over
    who = f"node{node} (worker {member.worker}) was lost"
    if member.gone:
        if _awaits_outputs(member) and not over:
            _fail(turn, JobState.FAILED, f"{who} before its outputs were stored: {event.why}")
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
        _fence(turn, cause, [], "MemberLost", network=False)
    elif not over:
        _fail(turn, JobState.FAILED, f"{who}: {event.why}")


def _link_back(turn: _Turn, event: LinkBack) -> None:
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
            _fail(turn, JobState.FAILED, f"{who} before its outputs were stored")
    elif report is None:
        turn.update(node, gone=True)
        turn.set_member(node, MemberState.LOST)
        turn.release(node)
        if not over:
            _fail(turn, JobState.FAILED, f"{who}: its agent dialled back without the member")
    elif report.exit_code is None:
        if over:
            turn.emit(SendStop(member.worker, run.reason))
        elif not member.started:
            turn.update(node, started=True)
            turn.set_member(node, MemberState.RUNNING)
    else:
        _member_exited(turn, MemberExited(node, report.exit_code, report.signal))
    if was_unconfirmed:
        _maybe_check(turn)
        _maybe_assign(turn)
    _maybe_running(turn)


def _tick(turn: _Turn) -> None:
    run = turn.run
    if not run.is_over and run.deadline is not None and turn.now > run.deadline:
        _fail(turn, JobState.FAILED, f"timed out after {run.timeout}s (spec.timeout)")
    if turn.run.hang_fail_at is not None and turn.now >= turn.run.hang_fail_at:
        _fail_hung(turn)
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
            _fence(
                turn,
                f"the probe did not finish within {probe_budget(turn.run):.0f}s: "
                + ", ".join(
                    f"node{m.node} (worker {m.worker}) "
                    + ("did not open its endpoint" if m.probe_port is None else "did not report")
                    for m in slow
                ),
                [pair for m in slow for pair in _with_everyone(turn.run, m.node)],
                "ProbeFailed",
            )
        elif turn.run.job_state is JobState.NETWORKING:
            late = [m for m in turn.run.members if not m.net_up]
            _fence(
                turn,
                f"the direct network was not up within {RENDEZVOUS_TIMEOUT_S:.0f}s: "
                + ", ".join(
                    f"node{m.node} (worker {m.worker}) "
                    + ("had no key" if m.net_key is None else "did not set its peers")
                    for m in late
                ),
                [pair for m in late for pair in _with_everyone(turn.run, m.node)],
                "DirectPathFailed",
            )
        elif turn.run.checking is not None:
            late = [m for m in turn.run.members if m.checked is None]
            _fence(
                turn,
                f"the members did not answer the check of node0's rendezvous within "
                f"{MASTER_CHECK_BUDGET_S:.0f}s: "
                + ", ".join(f"node{m.node} (worker {m.worker})" for m in late),
                [pair for m in late for pair in _with_everyone(turn.run, m.node)],
                "MasterUnreachable",
            )
        else:
            _fail(
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
            _fence(turn, cause, [], "MemberLost", network=False)  # nothing of the user's ran
        else:
            _fail(turn, JobState.FAILED, cause)


def _restarted(turn: _Turn, event: ControllerRestarted) -> None:
    turn.run = replace(
        turn.run,
        grace_deadline=event.grace_deadline,
        rendezvous_deadline=event.grace_deadline + RENDEZVOUS_TIMEOUT_S,
    )
    run = turn.run
    unstarted = len(run.members) > 1 and not any(m.assigned for m in run.members)
    if unstarted and (
        run.job_state is JobState.NETWORKING or (run.path in _BUILT_PATHS and run.published is None)
    ):
        # The join keys, the mesh addresses and the probe's progress of a network not yet
        # in use went with the controller's memory, and nothing of the user's ran: fence
        # the epoch and place the gang again. (Its devices come down on the agents' side:
        # an agent that dials in again drops a device no member of its uses, and a new
        # epoch's device replaces an old one.)
        cause = "the controller restarted while the gang's network was being set up"
        _fence(turn, cause, [], "ControllerRestarted", network=False)
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


# ---- failure -----------------------------------------------------------------------------


def _with_everyone(run: GangRun, node: int) -> list[tuple[int, int]]:
    return [(node, m.node) for m in run.members if m.node != node]


def _fence(
    turn: _Turn,
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
    small. Not billed: nothing of the user's ran. After MAX_NETWORK_EPOCHS such epochs, or
    once a member was assigned, the job fails."""
    run = turn.run
    if run.is_over:
        return
    path = run.path or PathClass.PRIVATE
    if network:  # (not for a lost member or a restart: the network was not found wanting)
        turn.emit(SetCondition("NetworkQualified", False, reason, cause))
    if run.epoch >= MAX_NETWORK_EPOCHS or any(m.assigned for m in run.members):
        _fail(turn, JobState.FAILED, f"{cause} (epoch {run.epoch}; not placed again)")
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
    _stop_members(turn, cause)
    turn.set_job(JobState.QUEUED, again)
    turn.run = replace(turn.run, fenced=True)


def _fail(turn: _Turn, state: JobState, cause: str) -> None:
    """Fail (or cancel) the job: STOP to members that may run, never-started ones cancelled."""
    if turn.run.is_over:
        return
    turn.set_job(state, cause)
    _stop_members(turn, cause)


def _stop_members(turn: _Turn, cause: str) -> None:
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
