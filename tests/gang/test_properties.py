"""The gang lifecycle under random event orders: simulated agents, invariants checked per step.

Agents are simulated just enough to send only what a real agent could (a member starts only
after its ASSIGN arrived, an agent whose link is down sends nothing until it dials back);
the order, the exit codes, lost links, agent and controller restarts, ticks and cancels are
drawn by hypothesis. Examples: ``MUSTER_HYPOTHESIS_EXAMPLES`` (default 300).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from muster.gang import (
    GANG_TRANSITIONS,
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
    ReleaseWorker,
    SendAssign,
    SendMasterCheck,
    SendPrepareRendezvous,
    SendStop,
    SetJobState,
    SetMemberState,
    Tick,
    step,
)
from muster.spec import JobState, MemberState, PathClass
from muster.spec.states import check_job_transition, check_member_transition

JOB, EPOCH = "job1", 1
EXITS = ((0, None), (1, None), (143, "SIGTERM"), (-9, "SIGKILL"))


@dataclass
class Agent:
    """What one agent holds of its member, truthfully."""

    worker: str
    node: int
    connected: bool = True
    prepared: bool = False
    asked: bool = False  # got MASTER_CHECK and has not answered it
    holds: bool = False  # got ASSIGN and has not finished (exit and upload) or restarted
    started: bool = False
    exit: tuple[int, str | None] | None = None
    outputs_sent: bool = False

    def report(self) -> tuple[MemberReport, ...]:
        if not self.holds:
            return ()
        code, signal = self.exit if self.exit is not None else (None, None)
        return (MemberReport(JOB, EPOCH, self.node, code, signal, last_log_seq=7),)


@dataclass
class Oracle:
    """What the actions so far promise, checked as each action arrives."""

    workers: tuple[str, ...]
    job_state: JobState = JobState.PLACING
    published: bool = False
    members: list[MemberState] = field(default_factory=list)
    assigned: list[bool] = field(default_factory=list)
    alive: list[bool] = field(default_factory=list)  # processes may exist
    exit_seen: list[int | None] = field(default_factory=list)
    stored: list[bool] = field(default_factory=list)
    released: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.workers)
        self.members = [MemberState.PENDING] * n
        self.assigned, self.alive, self.stored = [False] * n, [False] * n, [False] * n
        self.exit_seen = [None] * n

    def gone(self, node: int, code: int | None) -> None:
        self.alive[node] = False
        if code is not None and self.assigned[node] and self.exit_seen[node] is None:
            self.exit_seen[node] = code

    def see(self, event: Event) -> list[int]:
        """Take in the event; the nodes a STOP must answer in this step."""
        ended = self.job_state in (JobState.FAILED, JobState.CANCELLED)
        if isinstance(event, PortPublished) and event.node == 0:
            self.published = True
        elif isinstance(event, MemberExited):
            self.gone(event.node, event.exit_code)
        elif isinstance(event, OutputsStored) and event.ok:
            self.stored[event.node] = True
        elif isinstance(event, MemberStarted):
            return [event.node] if ended and self.alive[event.node] else []
        elif isinstance(event, LinkBack):
            node = self.workers.index(event.worker)
            reports = [r for r in event.members if r.node == node]
            if not reports:
                self.gone(node, None)
            elif reports[0].exit_code is not None:
                self.gone(node, reports[0].exit_code)
            elif ended and self.alive[node]:
                return [node]
        return []

    def check(self, actions: tuple[Action, ...], must_stop: list[int]) -> None:
        before = self.job_state
        stopped = {a.worker for a in actions if isinstance(a, SendStop)}
        for action in actions:
            if isinstance(action, SetJobState):
                assert not self.job_state.is_terminal, f"terminal job moved: {action}"
                check_job_transition(self.job_state, action.state)
                if action.state is JobState.SUCCEEDED:
                    assert self.exit_seen == [0] * len(self.workers), self.exit_seen
                    assert all(self.stored)
                self.job_state = action.state
            elif isinstance(action, SetMemberState):
                check_member_transition(self.members[action.node], action.state)
                self.members[action.node] = action.state
            elif isinstance(action, SendAssign):
                assert self.published, "ASSIGN before node 0 published its port"
                assert not self.assigned[action.node], f"node{action.node} assigned twice"
                assert action.node == 0 or self.assigned[0], "ASSIGN went to node 0 after others"
                assert action.worker == self.workers[action.node]
                self.assigned[action.node] = self.alive[action.node] = True
            elif isinstance(action, ReleaseWorker):
                assert action.worker not in self.released, f"{action.worker} released twice"
                node = self.workers.index(action.worker)
                assert not self.alive[node], f"{action.worker} released while node{node} may run"
                self.released.append(action.worker)
        if self.job_state in (JobState.FAILED, JobState.CANCELLED) and not before.is_terminal:
            must_stop = must_stop + [n for n, alive in enumerate(self.alive) if alive]
        for node in must_stop:
            assert self.workers[node] in stopped, f"node{node} may run and got no STOP"


class World:
    def __init__(self, n: int, timeout: int | None) -> None:
        workers = tuple(f"w{i}" for i in range(n))
        self.agents = [Agent(w, i) for i, w in enumerate(workers)]
        self.oracle = Oracle(workers)
        self.run = GangRun()
        self.now = 0.0
        placed = Placed(JOB, EPOCH, workers, PathClass.PRIVATE, None, timeout, "10.0.0.1")
        self.apply(placed)

    def apply(self, event: Event) -> None:
        must_stop = self.oracle.see(event)
        before = self.run.phase
        self.run, actions = step(self.run, event, self.now)
        after = self.run.phase
        assert after is before or reachable(before, after), f"{before} -> {after}"
        self.oracle.check(actions, must_stop)
        assert self.run.job_state is self.oracle.job_state
        for action in actions:
            if isinstance(action, SendPrepareRendezvous | SendAssign):
                agent = self.agents[self.run.node_of(action.worker) or 0]
                if agent.connected:  # a send without a link is dropped
                    agent.prepared = agent.prepared or isinstance(action, SendPrepareRendezvous)
                    agent.holds = agent.holds or isinstance(action, SendAssign)
            if isinstance(action, SendMasterCheck):
                agent = self.agents[action.node]
                agent.asked = agent.asked or agent.connected

    def choices(self, calm: int) -> list[tuple[str, int, int]]:
        """Every move a real agent, clock, user or operator could make now; the moves of a
        healthy run repeated ``calm`` times, so that runs reach success too."""
        moves: list[tuple[str, int, int]] = [("tick", 0, 0), ("cancel", 0, 0), ("restart", 0, 0)]
        moves += [("back", a.node, 0) for a in self.agents if not a.connected] * calm
        moves += [("port-from", a.node, 0) for a in self.agents[1:]]
        for a in self.agents:
            if a.connected:
                moves.append(("lose", a.node, 0))
                if a.node == 0 and a.prepared:
                    moves += [("publish", 0, 0)] * calm
                if a.asked:
                    moves += [("checked", a.node, 0)] * calm + [("checked", a.node, 1)]
            else:
                moves.append(("back", a.node, 0))
                if a.holds:
                    moves.append(("agent-restart", a.node, 0))
            if a.holds and a.exit is None:
                moves += [("exit", a.node, i) for i in range(len(EXITS))]
                if a.started:
                    moves += [("exit", a.node, 0)] * calm
                if a.connected and not a.started:
                    moves += [("start", a.node, 0)] * calm
            if a.connected and a.holds and a.exit is not None and not a.outputs_sent:
                moves += [("outputs", a.node, 1)] * calm + [("outputs", a.node, 0)]
        return moves

    def move(self, kind: str, node: int, arg: int) -> None:
        agent = self.agents[node]
        if kind == "tick":
            self.now += 7.0
            self.apply(Tick())
        elif kind == "cancel":
            self.apply(Cancel("cancelled by the user"))
        elif kind == "restart":
            self.restart()
        elif kind == "port-from":
            self.apply(PortPublished(node, "10.0.0.9", 1234))
        elif kind == "publish":
            self.apply(PortPublished(0, "10.0.0.1", 29500))
        elif kind == "checked":  # 1: it could not reach node 0's port
            agent.asked = False
            self.apply(MasterChecked(node, "connection refused" if arg else None, "2.13.0"))
        elif kind == "lose":
            agent.connected = False
            self.apply(LinkLost(agent.worker, "no heartbeat"))
        elif kind == "back":
            agent.connected = True
            self.apply(LinkBack(agent.worker, agent.report()))
        elif kind == "agent-restart":  # its processes die with it, and it forgets them
            agent.holds, agent.started = False, False
        elif kind == "exit":
            agent.exit = EXITS[arg]
            if agent.connected:
                code, signal = EXITS[arg]
                self.apply(MemberExited(node, code, signal, tail=("x",)))
        elif kind == "start":
            agent.started = True
            self.apply(MemberStarted(node))
        elif kind == "outputs":
            agent.outputs_sent, agent.holds = True, False
            self.apply(OutputsStored(node, ok=bool(arg), errors=() if arg else ("out: failed",)))

    def restart(self) -> None:
        """The controller restarts: links drop, the run is rebuilt from what the store holds."""
        for agent in self.agents:
            agent.connected = False
        run = self.run
        self.run = GangRun.restore(
            run.job,
            run.epoch,
            PathClass.PRIVATE,
            run.job_state,
            [
                MemberSnapshot(m.worker, m.state, m.exit_code, m.outputs, m.released, m.assigned)
                for m in run.members
            ],
            reason=run.reason,
            master_addr=run.master_addr,
            port=run.port,
            published=run.published,
            timeout=run.timeout,
            deadline=run.deadline,
        )
        self.apply(ControllerRestarted(grace_deadline=self.now + 10))

    def drain(self) -> None:
        """Everyone dials back, the job is cancelled, every member still running exits."""
        for agent in self.agents:
            if not agent.connected:
                self.move("back", agent.node, 0)
        self.apply(Cancel("drain"))
        for agent in self.agents:
            if agent.holds and agent.exit is None:
                self.move("exit", agent.node, 2)


def reachable(start: GangPhase, end: GangPhase) -> bool:
    seen, todo = set(), [start]
    while todo:
        for nxt in GANG_TRANSITIONS[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return end in seen


@settings(
    max_examples=int(os.environ.get("MUSTER_HYPOTHESIS_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    n=st.integers(min_value=1, max_value=3),
    timeout=st.sampled_from([None, 60]),
    calm=st.sampled_from([1, 5, 30]),
    data=st.data(),
)
def test_random_event_orders_keep_the_invariants(
    n: int, timeout: int | None, calm: int, data: st.DataObject
) -> None:
    world = World(n, timeout)
    for _ in range(data.draw(st.integers(min_value=0, max_value=40), label="steps")):
        choices = world.choices(calm)
        world.move(*data.draw(st.sampled_from(choices), label="move"))
    event(f"before the drain: {world.run.phase.value}")
    world.drain()
    assert world.run.is_over
    assert world.run.settled, world.run
    assert sorted(world.oracle.released) == sorted(a.worker for a in world.agents)
    assert not any(world.run.must_stop(a.worker) for a in world.agents)


def test_a_happy_gang_succeeds_in_any_start_and_exit_order() -> None:
    world = World(3, None)
    world.move("publish", 0, 0)
    for node in (1, 0, 2):
        world.move("checked", node, 0)
    for node in (2, 0, 1):
        world.move("start", node, 0)
    for node in (1, 2, 0):
        world.move("exit", node, 0)
        world.move("outputs", node, 1)
    assert world.run.job_state is JobState.SUCCEEDED
    assert world.run.settled
