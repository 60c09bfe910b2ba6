"""The gang lifecycle, table-driven: (phase, event) -> (phase, actions), exactly."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from muster.errors import BadRequest
from muster.gang import (
    Action,
    Cancel,
    ControllerRestarted,
    Event,
    GangPhase,
    GangRun,
    LinkBack,
    LinkLost,
    MasterChecked,
    MemberExited,
    MemberReport,
    MemberSnapshot,
    MemberStarted,
    OutputsStored,
    Placed,
    PortPublished,
    RecordEvent,
    ReleaseWorker,
    SendAssign,
    SendMasterCheck,
    SendPrepareRendezvous,
    SendStop,
    SetCondition,
    SetJobState,
    SetMemberState,
    SetRendezvous,
    Tick,
    root_cause,
    step,
)
from muster.gang.catalogue import classify
from muster.spec import JobState, MemberState, PathClass

J, M, P = JobState, MemberState, GangPhase
W = ("w0", "w1", "w2")
PLACED = Placed("job1", 1, W, PathClass.PRIVATE, port=None, timeout=60, master_addr="10.0.0.1")
PUBLISHED = PortPublished(0, "10.0.0.1", 29500)
CHECKED = tuple(MasterChecked(n, None, "2.13.0", None) for n in range(3))
STARTED = tuple(MemberStarted(n) for n in range(3))
EXITED_0 = tuple(MemberExited(n, 0) for n in range(3))
STORED = tuple(OutputsStored(n, ok=True) for n in range(3))
BOOM = MemberExited(1, 1, failed_rank=5, failed_exit=1, tail=("Traceback", "RuntimeError: x"))
BOOM_CAUSE = (
    "node1 (worker w1): global rank 5 exited with code 1\n"
    "last lines of rank 5:\n  Traceback\n  RuntimeError: x"
)

# Prefixes that bring a run to each phase (all at now=0; the timeout is 60 s).
RENDEZVOUS: tuple[Event, ...] = (PLACED,)
CHECKING: tuple[Event, ...] = (*RENDEZVOUS, PUBLISHED)
STARTING: tuple[Event, ...] = (*CHECKING, *CHECKED)
RUNNING: tuple[Event, ...] = (*STARTING, *STARTED)
ALL_EXITED: tuple[Event, ...] = (*RUNNING, *EXITED_0)
SUCCEEDED: tuple[Event, ...] = (*ALL_EXITED, *STORED)
FAILED: tuple[Event, ...] = (*RUNNING, BOOM)  # node 1 failed; nodes 0 and 2 still running
CANCELLED: tuple[Event, ...] = (*RUNNING, Cancel("cancelled by the user"))
FAILED_EARLY: tuple[Event, ...] = (
    *STARTING,
    MemberStarted(0),
    MemberExited(0, 1),
)  # 1 and 2 never started


def run_through(events: Sequence[Event], now: float = 0.0) -> GangRun:
    run = GangRun()
    for event in events:
        run, _ = step(run, event, now)
    return run


def assigned(node: int) -> list[Action]:
    worker = W[node]
    return [
        SendAssign(node, worker),
        SetMemberState(node, M.ASSIGNED),
        RecordEvent(
            "Assigned", f"node{node} (worker {worker}) assigned", {"node": node, "worker": worker}
        ),
    ]


def started(node: int) -> list[Action]:
    return [SetMemberState(node, M.STARTING), SetMemberState(node, M.RUNNING)]


def cancel_unassigned(*nodes: int) -> list[Action]:
    return [a for n in nodes for a in (SetMemberState(n, M.CANCELLED), ReleaseWorker(W[n]))]


def cancel_holding(cause: str, *others: int) -> list[Action]:
    """Cancel the unassigned members; node 0, which holds the rendezvous port, is told."""
    return [*cancel_unassigned(0), SendStop("w0", cause), *cancel_unassigned(*others)]


def stop(cause: str, *nodes: int) -> list[Action]:
    return [SendStop(W[n], cause) for n in nodes]


# A silent SIGKILL is the OOM killer's mark (muster.gang.catalogue): named, with the fix.
KILLED = classify([], "SIGKILL")
assert KILLED is not None
KILLED_CAUSE = "node1 (worker w1): torchrun was killed by SIGKILL\n" + KILLED.text()
TIMEOUT = "timed out after 60s (spec.timeout)"
USER = "cancelled by the user"
LOST_W1 = "node1 (worker w1) was lost: no heartbeat for 30s"
FENCED_LOST_W1 = (
    "epoch 1 fenced: node1 (worker w1) was lost before any rank started: no heartbeat for "
    "30s; placing the gang again"
)
ALIVE_W2 = LinkBack("w2", (MemberReport("job1", 1, 2),))
GRACE = ControllerRestarted(grace_deadline=30.0)

CASES = [
    # ---- unplaced
    pytest.param(
        (),
        PLACED,
        0,
        P.RENDEZVOUS,
        [
            SetJobState(J.RENDEZVOUS, "epoch 1: waiting for node0 to publish its address"),
            SendPrepareRendezvous("w0", "10.0.0.1", None),
        ],
        id="unplaced-placed",
    ),
    pytest.param((), PUBLISHED, 0, P.UNPLACED, [], id="unplaced-port-ignored"),
    pytest.param((), Cancel(USER), 0, P.UNPLACED, [], id="unplaced-cancel-ignored"),
    pytest.param((), Tick(), 99, P.UNPLACED, [], id="unplaced-tick-ignored"),
    # ---- rendezvous: waiting for node 0's port
    pytest.param(
        RENDEZVOUS,
        PUBLISHED,
        0,
        P.RENDEZVOUS,
        [
            RecordEvent(
                "RendezvousCheck",
                "epoch 1: every member dials node0's rendezvous at 10.0.0.1:29500 before any "
                "rank starts",
                {"addr": "10.0.0.1", "port": 29500},
            ),
            SendMasterCheck(0, "w0", None, 29500),
            SendMasterCheck(1, "w1", "10.0.0.1", 29500),
            SendMasterCheck(2, "w2", "10.0.0.1", 29500),
        ],
        id="rendezvous-node0-publishes-every-member-dials-it",
    ),
    pytest.param(
        (*CHECKING, CHECKED[0], CHECKED[2]),
        CHECKED[1],
        0,
        P.STARTING,
        [
            SetRendezvous("10.0.0.1", 29500),
            RecordEvent(
                "RendezvousPublished",
                "node0 published 10.0.0.1:29500",
                {"addr": "10.0.0.1", "port": 29500},
            ),
            *assigned(0),
            *assigned(1),
            *assigned(2),
        ],
        id="checking-the-last-member-reached-it-assign-node0-first",
    ),
    pytest.param(
        RENDEZVOUS, PortPublished(1, "10.0.0.2", 1), 0, P.RENDEZVOUS, [], id="rendezvous-node1-port"
    ),
    pytest.param(RENDEZVOUS, PLACED, 0, P.RENDEZVOUS, [], id="rendezvous-placed-again"),
    pytest.param(RENDEZVOUS, MemberStarted(0), 0, P.RENDEZVOUS, [], id="rendezvous-unassigned"),
    pytest.param(
        RENDEZVOUS, MemberExited(1, 1), 0, P.RENDEZVOUS, [], id="rendezvous-unassigned-exit"
    ),
    pytest.param(
        RENDEZVOUS, OutputsStored(1, ok=False), 0, P.RENDEZVOUS, [], id="rendezvous-outputs"
    ),
    pytest.param(
        RENDEZVOUS, LinkLost("stranger", "eof"), 0, P.RENDEZVOUS, [], id="rendezvous-stranger"
    ),
    pytest.param(
        RENDEZVOUS,
        LinkLost("w1", "no heartbeat for 30s"),
        0,
        P.FENCED,
        [
            SetMemberState(1, M.LOST),
            ReleaseWorker("w1"),
            SetCondition("GangReady", False, "MemberLost", FENCED_LOST_W1),
            RecordEvent(
                "EpochFenced",
                FENCED_LOST_W1,
                {"epoch": 1, "path": "private", "reason": "MemberLost", "apart": []},
            ),
            *cancel_holding(
                "node1 (worker w1) was lost before any rank started: no heartbeat for 30s", 2
            ),
            SetJobState(J.QUEUED, FENCED_LOST_W1),
        ],
        id="rendezvous-member-lost-placed-again",
    ),
    pytest.param(
        RENDEZVOUS,
        Cancel(USER),
        0,
        P.CANCELLED,
        [SetJobState(J.CANCELLED, USER), *cancel_holding(USER, 1, 2)],
        id="rendezvous-cancel",
    ),
    pytest.param(RENDEZVOUS, Tick(), 60, P.RENDEZVOUS, [], id="rendezvous-tick-at-deadline"),
    pytest.param(
        RENDEZVOUS,
        Tick(),
        60.5,
        P.FAILED,
        [SetJobState(J.FAILED, TIMEOUT), *cancel_holding(TIMEOUT, 1, 2)],
        id="rendezvous-timeout",
    ),
    # ---- starting: assigned, waiting for every member to start
    pytest.param(STARTING, MemberStarted(1), 0, P.STARTING, started(1), id="starting-one-starts"),
    pytest.param(
        (*STARTING, MemberStarted(0), MemberStarted(2)),
        MemberStarted(1),
        0,
        P.RUNNING,
        [*started(1), SetJobState(J.RUNNING, "all 3 nodes started")],
        id="starting-last-starts",
    ),
    pytest.param(
        (*STARTING, MemberStarted(1)), MemberStarted(1), 0, P.STARTING, [], id="starting-twice"
    ),
    pytest.param(STARTING, PUBLISHED, 0, P.STARTING, [], id="starting-port-again"),
    pytest.param(
        (*STARTING, MemberStarted(0), MemberStarted(1)),
        BOOM,
        0,
        P.FAILED,
        [
            SetMemberState(1, M.FAILED, 1, None),
            ReleaseWorker("w1"),
            SetJobState(J.FAILED, BOOM_CAUSE),
            SendStop("w0", BOOM_CAUSE),
            SetMemberState(2, M.CANCELLED),
            SendStop("w2", BOOM_CAUSE),
        ],
        id="starting-member-fails-others-stopped-or-cancelled",
    ),
    pytest.param(
        STARTING,
        MemberExited(2, 127),
        0,
        P.FAILED,
        [
            SetMemberState(2, M.FAILED, 127, None),
            ReleaseWorker("w2"),
            SetJobState(J.FAILED, "node2 (worker w2): torchrun exited with code 127"),
            SetMemberState(0, M.CANCELLED),
            SendStop("w0", "node2 (worker w2): torchrun exited with code 127"),
            SetMemberState(1, M.CANCELLED),
            SendStop("w1", "node2 (worker w2): torchrun exited with code 127"),
        ],
        id="starting-never-started-member-fails",
    ),
    pytest.param(
        (*STARTING, MemberStarted(0)),
        LinkLost("w0", "eof"),
        0,
        P.FAILED,
        [
            SetMemberState(0, M.LOST),
            SetJobState(J.FAILED, "node0 (worker w0) was lost: eof"),
            *stop("node0 (worker w0) was lost: eof", 0),
            SetMemberState(1, M.CANCELLED),
            *stop("node0 (worker w0) was lost: eof", 1),
            SetMemberState(2, M.CANCELLED),
            *stop("node0 (worker w0) was lost: eof", 2),
        ],
        id="starting-member-lost-not-released",
    ),
    # ---- running
    pytest.param(
        RUNNING,
        MemberExited(0, 0),
        0,
        P.RUNNING,
        [SetMemberState(0, M.SUCCEEDED, 0, None), ReleaseWorker("w0")],
        id="running-member-exits-0",
    ),
    pytest.param(RUNNING, OutputsStored(0, ok=True), 0, P.RUNNING, [], id="running-outputs-early"),
    pytest.param(
        (*ALL_EXITED, *STORED[:2]),
        STORED[2],
        0,
        P.SUCCEEDED,
        [SetJobState(J.SUCCEEDED, "all 3 nodes exited 0")],
        id="running-last-outputs-succeed",
    ),
    pytest.param(
        (*RUNNING, *EXITED_0[:2], *STORED),
        EXITED_0[2],
        0,
        P.SUCCEEDED,
        [
            SetMemberState(2, M.SUCCEEDED, 0, None),
            ReleaseWorker("w2"),
            SetJobState(J.SUCCEEDED, "all 3 nodes exited 0"),
        ],
        id="running-last-exit-after-outputs-succeed",
    ),
    pytest.param(
        (*ALL_EXITED, *STORED[:2]),
        OutputsStored(2, ok=False, errors=("model.pt: disk full", "log.txt: gone")),
        0,
        P.FAILED,
        [
            SetJobState(
                J.FAILED,
                "node2 (worker w2) could not upload 2 output file(s); they stay in the agent's "
                "work dir:\n  model.pt: disk full\n  log.txt: gone",
            )
        ],
        id="running-outputs-fail",
    ),
    pytest.param(
        (*RUNNING, MemberExited(0, 0)),
        LinkLost("w0", "eof"),
        0,
        P.FAILED,
        [
            SetJobState(J.FAILED, "node0 (worker w0) was lost before its outputs were stored: eof"),
            *stop("node0 (worker w0) was lost before its outputs were stored: eof", 1, 2),
        ],
        id="running-exited-0-lost-before-outputs",
    ),
    pytest.param(
        (*RUNNING, MemberExited(0, 0), OutputsStored(0, ok=True)),
        LinkLost("w0", "eof"),
        0,
        P.RUNNING,
        [],
        id="running-done-member-lost-harmless",
    ),
    pytest.param(
        RUNNING,
        MemberExited(1, -9, signal="SIGKILL"),
        0,
        P.FAILED,
        [
            SetMemberState(1, M.FAILED, -9, "SIGKILL"),
            ReleaseWorker("w1"),
            SetJobState(J.FAILED, KILLED_CAUSE),
            *stop(KILLED_CAUSE, 0, 2),
        ],
        id="running-member-killed",
    ),
    pytest.param(
        RUNNING,
        Tick(),
        61,
        P.FAILED,
        [SetJobState(J.FAILED, TIMEOUT), *stop(TIMEOUT, 0, 1, 2)],
        id="running-timeout",
    ),
    pytest.param(
        RUNNING,
        Cancel(USER),
        0,
        P.CANCELLED,
        [SetJobState(J.CANCELLED, USER), *stop(USER, 0, 1, 2)],
        id="running-cancel",
    ),
    # ---- failed: the job state stays; exits release workers
    pytest.param(
        FAILED,
        MemberExited(0, 143, signal="SIGTERM"),
        0,
        P.FAILED,
        [SetMemberState(0, M.CANCELLED, 143, "SIGTERM"), ReleaseWorker("w0")],
        id="failed-stopped-member-exits",
    ),
    pytest.param(
        FAILED,
        MemberExited(0, 0),
        0,
        P.FAILED,
        [SetMemberState(0, M.SUCCEEDED, 0, None), ReleaseWorker("w0")],
        id="failed-member-exits-0",
    ),
    pytest.param(
        FAILED,
        MemberExited(2, 1),
        0,
        P.FAILED,
        [SetMemberState(2, M.FAILED, 1, None), ReleaseWorker("w2")],
        id="failed-member-exits-1",
    ),
    pytest.param(FAILED, MemberExited(1, 1), 0, P.FAILED, [], id="failed-exit-twice"),
    pytest.param(FAILED, Cancel(USER), 0, P.FAILED, [], id="failed-cancel"),
    pytest.param(FAILED, Tick(), 1000, P.FAILED, [], id="failed-tick"),
    pytest.param(FAILED, PUBLISHED, 0, P.FAILED, [], id="failed-port"),
    pytest.param(
        FAILED, LinkLost("w2", "eof"), 0, P.FAILED, [SetMemberState(2, M.LOST)], id="failed-lost"
    ),
    pytest.param(
        (*FAILED, LinkLost("w2", "eof")),
        ALIVE_W2,
        0,
        P.FAILED,
        [SendStop("w2", BOOM_CAUSE)],
        id="failed-linkback-alive-stop-again",
    ),
    pytest.param(
        (*FAILED, LinkLost("w2", "eof")),
        LinkBack("w2", (MemberReport("job1", 2, 2), MemberReport("other", 1, 2))),
        0,
        P.FAILED,
        [ReleaseWorker("w2")],
        id="failed-linkback-without-member-release",
    ),
    pytest.param(
        (*FAILED, LinkLost("w2", "eof")),
        LinkBack("w2", (MemberReport("job1", 1, 2, exit_code=143, signal="SIGTERM"),)),
        0,
        P.FAILED,
        [ReleaseWorker("w2")],
        id="failed-linkback-exited-release",
    ),
    pytest.param(
        FAILED,
        OutputsStored(0, ok=False, errors=("a: b",)),
        0,
        P.FAILED,
        [
            RecordEvent(
                "OutputsFailed",
                "node0 (worker w0) could not upload 1 output file(s); they stay in the agent's "
                "work dir:\n  a: b",
                {"node": 0, "errors": ["a: b"]},
            )
        ],
        id="failed-outputs-fail-recorded",
    ),
    pytest.param(
        FAILED_EARLY,
        MemberStarted(1),
        0,
        P.FAILED,
        [SendStop("w1", "node0 (worker w0): torchrun exited with code 1")],
        id="failed-cancelled-member-starts-anyway-stop",
    ),
    pytest.param(
        FAILED_EARLY,
        MemberExited(1, 143, signal="SIGTERM"),
        0,
        P.FAILED,
        [ReleaseWorker("w1")],
        id="failed-cancelled-member-reports-exit",
    ),
    pytest.param(
        (*STARTING, GRACE, LinkBack("w1", (MemberReport("job1", 1, 1),)), Cancel(USER)),
        MemberStarted(1),
        0,
        P.CANCELLED,
        [SendStop("w1", USER)],
        id="cancelled-member-reported-alive-then-starts-stop-again",
    ),
    # ---- cancelled, succeeded
    pytest.param(
        CANCELLED,
        MemberExited(0, 143, signal="SIGTERM"),
        0,
        P.CANCELLED,
        [SetMemberState(0, M.CANCELLED, 143, "SIGTERM"), ReleaseWorker("w0")],
        id="cancelled-member-exits",
    ),
    pytest.param(
        CANCELLED,
        BOOM,
        0,
        P.CANCELLED,
        [SetMemberState(1, M.FAILED, 1, None), ReleaseWorker("w1")],
        id="cancelled-member-fails",
    ),
    pytest.param(SUCCEEDED, LinkLost("w0", "eof"), 0, P.SUCCEEDED, [], id="succeeded-lost"),
    pytest.param(SUCCEEDED, Cancel(USER), 0, P.SUCCEEDED, [], id="succeeded-cancel"),
    pytest.param(SUCCEEDED, Tick(), 1000, P.SUCCEEDED, [], id="succeeded-tick"),
    # ---- controller restarted: members unconfirmed until they dial back
    pytest.param(
        RUNNING,
        GRACE,
        0,
        P.RUNNING,
        [
            RecordEvent(
                "AwaitingMembers",
                "epoch 1: the controller restarted; waiting for node0, node1, node2 to dial back",
                {"nodes": [0, 1, 2], "grace_deadline": 30.0},
            )
        ],
        id="running-restarted",
    ),
    pytest.param(
        (*RUNNING, GRACE, LinkBack("w0", (MemberReport("job1", 1, 0),))),
        Tick(),
        30,
        P.FAILED,
        [
            SetMemberState(1, M.LOST),
            SetMemberState(2, M.LOST),
            SetJobState(
                J.FAILED,
                "node1 (worker w1) did not dial back within the grace after the controller "
                "restarted (nor did 1 more)",
            ),
            *stop(
                "node1 (worker w1) did not dial back within the grace after the controller "
                "restarted (nor did 1 more)",
                0,
                1,
                2,
            ),
        ],
        id="restarted-grace-expires",
    ),
    pytest.param((*RUNNING, GRACE), Tick(), 29.5, P.RUNNING, [], id="restarted-tick-inside-grace"),
    pytest.param(
        (*RUNNING, GRACE),
        LinkBack("w1", (MemberReport("job1", 1, 1, exit_code=1),)),
        0,
        P.FAILED,
        [
            SetMemberState(1, M.FAILED, 1, None),
            ReleaseWorker("w1"),
            SetJobState(J.FAILED, "node1 (worker w1): torchrun exited with code 1"),
            *stop("node1 (worker w1): torchrun exited with code 1", 0, 2),
        ],
        id="restarted-linkback-reports-failure",
    ),
    pytest.param(
        (*RUNNING, GRACE),
        LinkBack("w1"),
        0,
        P.FAILED,
        [
            SetMemberState(1, M.LOST),
            ReleaseWorker("w1"),
            SetJobState(
                J.FAILED, "node1 (worker w1) was lost: its agent dialled back without the member"
            ),
            *stop("node1 (worker w1) was lost: its agent dialled back without the member", 0, 2),
        ],
        id="restarted-linkback-member-gone",
    ),
]


@pytest.mark.parametrize(("prefix", "event", "now", "phase", "actions"), CASES)
def test_transition(
    prefix: tuple[Event, ...], event: Event, now: float, phase: GangPhase, actions: list[Action]
) -> None:
    before = run_through(prefix)
    after, decided = step(before, event, now)
    assert list(decided) == actions
    assert after.phase is phase


TERMINAL: dict[str, tuple[Event, ...]] = {
    "failed": FAILED,
    "cancelled": CANCELLED,
    "succeeded": SUCCEEDED,
}
ANY_EVENT: list[Event] = [
    PLACED,
    PUBLISHED,
    *STARTED,
    *EXITED_0,
    BOOM,
    *STORED,
    OutputsStored(0, ok=False),
    LinkLost("w0", "eof"),
    LinkBack("w0"),
    ALIVE_W2,
    Tick(),
    Cancel(USER),
    GRACE,
]


@pytest.mark.parametrize("name", sorted(TERMINAL))
@pytest.mark.parametrize("event", ANY_EVENT, ids=repr)
def test_terminal_job_state_never_changes(name: str, event: Event) -> None:
    before = run_through(TERMINAL[name])
    after, decided = step(before, event, 1000.0)
    assert after.job_state is before.job_state
    assert not [a for a in decided if isinstance(a, SetJobState)]


def test_step_leaves_its_input_unchanged() -> None:
    before = run_through(RUNNING)
    snapshot = repr(before)
    step(before, BOOM, 0)
    assert repr(before) == snapshot


def test_a_restored_gang_waits_for_every_member_before_it_assigns() -> None:
    run = GangRun.restore(
        "job1",
        1,
        PathClass.PRIVATE,
        J.PLACING,
        [MemberSnapshot(w, M.PENDING) for w in W],
        master_addr="10.0.0.1",
        port=29500,
    )
    run, actions = step(run, GRACE, 0)
    assert actions[0] == SetJobState(
        J.RENDEZVOUS, "epoch 1: waiting for node0 to publish its address"
    )
    run, actions = step(run, LinkBack("w0"), 1)
    assert actions == (SendPrepareRendezvous("w0", "10.0.0.1", 29500),)
    run, actions = step(run, PortPublished(0, "10.0.0.1", 29500), 2)
    assert actions == ()  # w1, w2 not back yet: nobody dials node 0's port
    run, actions = step(run, LinkBack("w2"), 3)
    assert actions == ()
    run, actions = step(run, LinkBack("w1"), 4)
    assert [a for a in actions if isinstance(a, SendMasterCheck)] == [
        SendMasterCheck(0, "w0", None, 29500),
        SendMasterCheck(1, "w1", "10.0.0.1", 29500),
        SendMasterCheck(2, "w2", "10.0.0.1", 29500),
    ]
    for event in CHECKED[:2]:
        run, actions = step(run, event, 5)
        assert actions == ()
    run, actions = step(run, CHECKED[2], 5)
    assert [a for a in actions if isinstance(a, SendAssign)] == [
        SendAssign(0, "w0"),
        SendAssign(1, "w1"),
        SendAssign(2, "w2"),
    ]
    run, actions = step(run, Tick(), 200)
    assert actions == ()
    assert run.phase is P.STARTING


def test_a_restored_ended_job_stops_what_still_runs_and_releases_the_rest() -> None:
    run = GangRun.restore(
        "job1",
        1,
        PathClass.DIRECT,
        J.FAILED,
        [
            MemberSnapshot("w0", M.RUNNING),
            MemberSnapshot("w1", M.FAILED, exit_code=1, released=True),
            MemberSnapshot("w2", M.CANCELLED, assigned=False),
        ],
        reason="node1 failed",
    )
    run, actions = step(run, GRACE, 0)
    assert actions[0] == ReleaseWorker("w2")
    assert [run.must_stop(w) for w in W] == [True, False, False]
    run, actions = step(run, LinkBack("w0", (MemberReport("job1", 1, 0),)), 1)
    assert actions == (SendStop("w0", "node1 failed"),)
    assert not run.settled
    run, actions = step(run, MemberExited(0, 143, signal="SIGTERM"), 2)
    assert actions == (SetMemberState(0, M.CANCELLED, 143, "SIGTERM"), ReleaseWorker("w0"))
    assert run.settled


def test_members_that_exit_before_they_are_seen_starting_still_make_the_job_run() -> None:
    run = run_through((*STARTING, MemberStarted(0), MemberStarted(1)))
    run, actions = step(run, MemberExited(2, 0), 0)
    assert list(actions) == [
        *started(2),
        SetJobState(J.RUNNING, "all 3 nodes started"),
        SetMemberState(2, M.SUCCEEDED, 0, None),
        ReleaseWorker("w2"),
    ]


def test_settled_and_must_stop_follow_the_members() -> None:
    run = run_through(FAILED)
    assert [run.must_stop(w) for w in (*W, "stranger")] == [True, False, True, False]
    run = run_through((*FAILED, MemberExited(0, 143, "SIGTERM"), MemberExited(2, 143, "SIGTERM")))
    assert run.settled
    assert [run.node_of(w) for w in (*W, "nobody")] == [0, 1, 2, None]


@pytest.mark.parametrize("workers", [(), ("w0", "w0")])
def test_a_gang_needs_distinct_workers(workers: tuple[str, ...]) -> None:
    with pytest.raises(BadRequest, match="distinct workers"):
        step(GangRun(), Placed("job1", 1, workers, PathClass.PRIVATE), 0)


@pytest.mark.parametrize(
    ("exited", "cause"),
    [
        (MemberExited(2, 1), "node2 (worker w2): torchrun exited with code 1"),
        (
            MemberExited(2, 1, failed_rank=9, failed_exit=3),
            "node2 (worker w2): global rank 9 exited with code 3",
        ),
        (
            MemberExited(2, -15, signal="SIGTERM", failed_rank=8),
            "node2 (worker w2): global rank 8 was killed by SIGTERM",
        ),
        (
            MemberExited(2, 1, tail=tuple(f"l{i}" for i in range(25))),
            "node2 (worker w2): torchrun exited with code 1\nlast lines of node2:\n"
            + "\n".join(f"  l{i}" for i in range(5, 25)),
        ),
    ],
)
def test_root_cause_text(exited: MemberExited, cause: str) -> None:
    assert root_cause(2, "w2", exited) == cause


def test_node0_that_cannot_prepare_the_rendezvous_fails_the_job() -> None:
    """The agent's answer to PREPARE_RENDEZVOUS when it cannot pick a port: node 0 never
    ran anything, the job fails at once naming it, and every worker goes back."""
    run = run_through(RENDEZVOUS)
    no_port = MemberExited(0, 127, tail=("muster agent: cannot pick a rendezvous port: x",))
    run, actions = step(run, no_port, 1.0)
    assert run.phase is P.FAILED
    assert "node0 (worker w0): torchrun exited with code 127" in run.reason
    assert "(preparing the rendezvous)" in run.reason
    assert {a.worker for a in actions if isinstance(a, ReleaseWorker)} == set(W)
    assert not [a for a in actions if isinstance(a, SendStop)]  # nothing was assigned


def test_a_node0_that_never_publishes_fails_the_job_after_the_rendezvous_timeout() -> None:
    run = run_through((Placed("job1", 1, W, PathClass.PRIVATE, master_addr="10.0.0.1"),))
    run, actions = step(run, Tick(), 119.0)
    assert run.phase is P.RENDEZVOUS
    assert actions == ()
    run, _ = step(run, Tick(), 121.0)
    assert run.phase is P.FAILED
    assert "did not publish its rendezvous address within 120s" in run.reason


def test_an_alive_member_the_store_never_saw_assigned_is_taken_as_running() -> None:
    """The controller stopped between sending ASSIGN and recording it: after the restart the
    agent says the member runs; it is taken as assigned and started, not ignored."""
    snapshots = [MemberSnapshot(w, M.PENDING) for w in W]
    run = GangRun.restore(
        "job1", 1, PathClass.PRIVATE, J.RENDEZVOUS, snapshots, published=("10.0.0.1", 29500)
    )
    run, _ = step(run, ControllerRestarted(100.0), 0.0)
    for node, worker in enumerate(W):
        report = MemberReport("job1", 1, node)
        run, _ = step(run, LinkBack(worker, (report,)), 1.0)
    assert run.phase is P.RUNNING
    assert all(m.assigned and m.started for m in run.members)


# ---- before any rank starts: every member dials node 0's held port, versions agree ---------


def test_a_member_that_cannot_reach_node0s_port_fences_the_epoch_before_any_rank_starts() -> None:
    run = run_through((*CHECKING, CHECKED[0], CHECKED[2]))
    refused = MasterChecked(1, "Connection refused", "2.13.0", None)
    run, actions = step(run, refused, 1)
    assert run.phase is P.FENCED
    assert not [a for a in actions if isinstance(a, SendAssign)]
    fenced = next(a for a in actions if isinstance(a, RecordEvent) and a.kind == "EpochFenced")
    assert fenced.data["reason"] == "MasterUnreachable"
    assert fenced.data["apart"] == [["w0", "w1"]]
    assert fenced.message.startswith(
        "epoch 1 fenced: node1 (worker w1) cannot reach node0's rendezvous at 10.0.0.1:29500 "
        "(worker w0): Connection refused; let TCP port 29500 of node0 in from the gang's members"
    ), fenced.message
    # node 0 lets its held port go; every member goes back, nothing of the user's ran
    assert SendStop("w0", fenced.message.split("fenced: ")[1].split("; placing")[0]) in actions


def test_members_on_different_torch_fail_the_job_naming_the_odd_one() -> None:
    run = run_through((*CHECKING, CHECKED[0], MasterChecked(2, None, "2.13.0", None)))
    run, actions = step(run, MasterChecked(1, None, "2.12.1", None), 1)
    assert run.job_state is J.FAILED
    assert run.reason == (
        "the members' torch differs: node1 (worker w1) runs torch 2.12.1, the others torch "
        "2.13.0: install torch==2.13.0 in every member's Python (`muster agent --python`)"
    )
    assert not [a for a in actions if isinstance(a, SendAssign)]


def test_nccl_is_compared_where_known_and_unknown_versions_are_not_a_mismatch() -> None:
    nccl = (
        MasterChecked(0, None, "2.13.0", "2.27.3"),
        MasterChecked(1, None, "2.13.0", None),  # a CPU build: NCCL not known
        MasterChecked(2, None, None, "2.21.5"),
    )
    run = run_through((*CHECKING, *nccl))
    assert run.job_state is J.FAILED
    assert run.reason.startswith(
        "the members' NCCL differs: node2 (worker w2) runs NCCL 2.21.5, the others NCCL 2.27.3"
    ), run.reason
    run = run_through((*CHECKING, *nccl[:2], MasterChecked(2, None, None, None)))
    assert run.phase is P.STARTING


def test_node0_does_not_dial_its_own_port_and_a_silent_member_fences_at_the_budget() -> None:
    run = run_through((*CHECKING, MasterChecked(0, "ignored", "2.13.0"), CHECKED[1]))
    assert run.checking is not None
    assert run.phase is P.RENDEZVOUS
    run, actions = step(run, Tick(), 29)
    assert actions == ()
    run, actions = step(run, Tick(), 31)
    assert run.phase is P.FENCED
    fenced = next(a for a in actions if isinstance(a, RecordEvent) and a.kind == "EpochFenced")
    assert "did not answer the check of node0's rendezvous within 30s: node2 (worker w2)" in (
        fenced.message
    )


def test_a_replaced_run_equals_what_dataclasses_replace_gives_and_refuses_unknown_fields() -> None:
    import dataclasses

    from muster.gang.run import GangRun, replace

    run = GangRun.placed("j", 1, ["a", "b"], PathClass.DIRECT)
    changed = replace(run, fenced=True, port=29500)
    assert changed == dataclasses.replace(run, fenced=True, port=29500)
    assert run.fenced is False  # the original is untouched
    assert run.port is None
    assert replace(run.members[1], exit_code=3) == dataclasses.replace(run.members[1], exit_code=3)
    with pytest.raises(TypeError, match="no field"):
        replace(run, fencd=True)
