"""One gang run's lifecycle: ``step(run, event, now) -> (run, actions)``, pure (seed 001).

The controller feeds every frame, link change, tick and API call for a run through ``step``
and applies the returned actions in order; the rules live in this package alone::

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

``step`` dispatches; the rules live beside it, one part of the run each: ``network`` (the
path's set-up, the probe, the rendezvous), ``gating`` (node 0's address, MASTER_CHECK,
ASSIGN), ``members`` (starts, exits, outputs), ``hang``, ``recovery`` (links, deadlines, a
controller restart), and ``turn`` (what they share: the step's state, failing and fencing).
"""

from __future__ import annotations

from muster.gang.actions import Action, SendNetSetup
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
    ProbeReady,
    StacksCaptured,
    Tick,
)
from muster.gang.gating import master_checked, port_published
from muster.gang.hang import fail_hung, hung, member_hung
from muster.gang.members import member_exited, member_started, outputs_stored
from muster.gang.network import (
    net_path,
    net_ready,
    net_up,
    probe_done,
    probe_ready,
    start_probe_or_rendezvous,
)
from muster.gang.recovery import link_back, link_lost, restarted, tick
from muster.gang.run import GangRun, replace
from muster.gang.turn import BUILT_PATHS, RENDEZVOUS_TIMEOUT_S, Turn, fail
from muster.spec import JobState


def step(run: GangRun, event: Event, now: float) -> tuple[GangRun, tuple[Action, ...]]:
    """Apply one event to the run; ``now`` is the controller's clock (seconds)."""
    turn = Turn(run, now)
    if isinstance(event, Placed):
        _placed(turn, event)
    elif not run.members:
        pass  # nothing but Placed means anything before the gang exists
    elif isinstance(event, NetReady):
        net_ready(turn, event)
    elif isinstance(event, NetUp):
        net_up(turn, event)
    elif isinstance(event, ProbeReady):
        probe_ready(turn, event)
    elif isinstance(event, ProbeDone):
        probe_done(turn, event)
    elif isinstance(event, NetPath):
        net_path(turn, event)
    elif isinstance(event, MemberHung):
        member_hung(turn, event)
    elif isinstance(event, StacksCaptured):
        fail_hung(turn, event.episode)
    elif isinstance(event, PortPublished):
        port_published(turn, event)
    elif isinstance(event, MasterChecked):
        master_checked(turn, event)
    elif isinstance(event, MemberStarted):
        member_started(turn, event)
    elif isinstance(event, MemberExited):
        member_exited(turn, event)
    elif isinstance(event, OutputsStored):
        outputs_stored(turn, event)
    elif isinstance(event, LinkLost):
        link_lost(turn, event)
    elif isinstance(event, LinkBack):
        link_back(turn, event)
    elif isinstance(event, Tick):
        tick(turn)
    elif isinstance(event, Cancel):
        if not run.is_over:
            fail(turn, JobState.CANCELLED, event.reason)
    elif isinstance(event, ControllerRestarted):
        restarted(turn, event)
    if turn.run.hang_timeout is not None:
        hung(turn)  # a member that started, ended or came back changes who is silent
    return turn.run, tuple(turn.actions)


def _placed(turn: Turn, event: Placed) -> None:
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
        spare_epochs=event.spare_epochs,
    )
    if event.path in BUILT_PATHS and len(event.workers) > 1:
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
    start_probe_or_rendezvous(turn)
