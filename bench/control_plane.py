"""Control plane under load: one real controller, 200 simulated agents, 1,000 queued gangs.

The controller is a real ``muster server`` subprocess (LocalCluster, no real agents) on
SQLite and, when a throwaway server can be started, PostgreSQL. 200 simulated agents (one
asyncio process) speak the real wire protocol: handshake with the join secret, INVENTORY,
heartbeats at the controller's interval, RENDEZVOUS_READY for PREPARE_RENDEZVOUS,
MASTER_CHECKED for MASTER_CHECK, MEMBER_STARTED for ASSIGN, then after ``--run-time``
MEMBER_EXITED 0, ARTIFACTS_DONE and a
fresh INVENTORY (as the real agent does). 1,000 jobs of 2-8 members go in through the
HTTP API (muster.client.Client, several submitting threads) while a paced reader calls
GET /v1/jobs and GET /v1/jobs/{id}.

Phases: the agents connect and heartbeat, but hold their INVENTORY; every job is submitted
(submit throughput, with the queue growing to 1,000); then every agent sends its INVENTORY
at once and the controller drains the queue (gangs placed per second, from that release
until every member of a gang has its ASSIGN). ``--live`` registers the agents first and
times placement from the first submit instead.

Anchor: the same placement decisions without I/O, muster.scheduler.schedule over a
PoolIndex of the same 200 workers and the same 1,000 queued jobs (the controller's first
pass after the release decides exactly this).

    .venv/bin/python bench/control_plane.py [--quick] [--repeat 1] [--no-postgres] [--live]

Goals (issue 9): >= 500 gangs placed/s, scheduler pass p99 < 100 ms with 1,000 queued,
API read p99 < 50 ms, 0 agents falsely lost.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import random
import re
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from muster import wire
from muster.cli.local import LocalCluster
from muster.client import Client, split_token
from muster.scheduler import Placement, PoolIndex, QueuedJob, schedule
from muster.spec import Gpus, NetworkCaps, PathClass, WorkerInventory, WorkerView, parse_job
from muster.store import open_store
from muster.wire import Kind

PRIVATE_NET = "bench-net"
TERMINAL = ("succeeded", "failed", "cancelled")


def inventory(index: int) -> WorkerInventory:
    address = f"127.0.{index // 250}.{index % 250 + 2}"
    return WorkerInventory(
        id=f"sim-{index:04d}",
        hostname=f"sim-{index:04d}",
        advertise_address=address,
        python_version="3.11.2",
        torch_version="2.5.1",
        torchrun=True,
        backends=["gloo"],
        gpus=Gpus(count=0),
        network=NetworkCaps(private_network_id=PRIVATE_NET, private_address=address),
    )


def job_specs(count: int, rnd: random.Random) -> list[dict[str, Any]]:
    return [
        {
            "name": f"cp-{i}",
            "entrypoint": "train.py",
            "distributed": {"num_workers": rnd.randint(2, 8), "backend": "gloo"},
        }
        for i in range(count)
    ]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ---- the simulated agents (their own process) ----------------------------------------------


@dataclass
class AgentStats:
    prepared: dict[str, float] = field(default_factory=dict)  # job -> PREPARE at node0
    assigned: dict[str, list[float]] = field(default_factory=dict)  # job -> ASSIGN times
    beats_sent: int = 0
    beat_rtt: list[float] = field(default_factory=list)
    beats_unanswered: int = 0
    max_beat_gap: float = 0.0
    stops: int = 0
    errors: list[str] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)  # links the controller ended under us
    members_done: int = 0
    interval: float = 3.0  # the controller's heartbeat interval


class SimAgent:
    """One agent: the real handshake and frames, a member that runs ``run_time`` seconds."""

    def __init__(self, index: int, url: str, secret: str, run_time: float, stats: AgentStats):
        self.inventory = inventory(index).model_dump(mode="json")
        self.id = str(self.inventory["id"])
        self.url, self.secret, self.run_time, self.stats = url, secret, run_time, stats
        self.ws: ClientConnection | None = None
        self.codec: wire.LinkCodec | None = None
        self.interval = 3.0
        self.beats: deque[float] = deque()
        self.members: dict[str, asyncio.Task[None]] = {}
        self.tasks: list[asyncio.Task[None]] = []
        self.stopping = False
        self._send_lock = asyncio.Lock()

    async def connect(self, gate: asyncio.Semaphore) -> None:
        async with gate:
            ws = await connect(self.url, max_size=64 << 20, ping_interval=None, open_timeout=60)
            challenge = wire.decode_plain(await asyncio.wait_for(ws.recv(), 60), Kind.CHALLENGE)
            cnonce, anonce = wire.new_nonce(), str(challenge["nonce"])
            proof = wire.auth_proof(self.secret, cnonce, anonce, self.id)
            await ws.send(
                wire.encode_plain(
                    Kind.AUTH, {"worker_id": self.id, "nonce": cnonce, "proof": proof}
                )
            )
            codec = wire.LinkCodec(
                wire.session_key(self.secret, cnonce, anonce),
                send=wire.TO_CONTROLLER,
                receive=wire.TO_AGENT,
            )
            welcome = codec.decode(await asyncio.wait_for(ws.recv(), 60))
            if welcome.kind is not Kind.WELCOME:
                raise RuntimeError(f"{self.id}: expected WELCOME, got {welcome.kind.name}")
            self.ws, self.codec = ws, codec
            self.interval = float(welcome.body["heartbeat_interval"])
            self.stats.interval = self.interval
        self.tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._beat())]

    async def send(self, kind: Kind, body: dict[str, Any]) -> None:
        async with self._send_lock:  # seq order on the wire must be encode order
            if self.ws is not None and self.codec is not None:
                with contextlib.suppress(ConnectionClosed):
                    await self.ws.send(self.codec.encode(kind, body))

    async def send_inventory(self) -> None:
        body = {"inventory": self.inventory, "running": [], "members": []}  # holds nothing
        await self.send(Kind.INVENTORY, body)

    async def _beat(self) -> None:
        await asyncio.sleep(random.uniform(0, self.interval))  # agents start at random times
        last = None
        while True:
            now = time.monotonic()
            if last is not None:
                self.stats.max_beat_gap = max(self.stats.max_beat_gap, now - last)
            last = now
            self.beats.append(now)
            self.stats.beats_sent += 1
            await self.send(Kind.HEARTBEAT, {"time": time.time()})
            await asyncio.sleep(self.interval)

    async def _read(self) -> None:
        assert self.ws is not None
        assert self.codec is not None
        try:
            async for message in self.ws:
                frame = self.codec.decode(message if isinstance(message, bytes) else b"")
                self._on_frame(frame.kind, frame.body, time.monotonic())
        except ConnectionClosed as exc:
            if not self.stopping:
                self.stats.closed.append(f"{self.id}: {exc}")

    def _on_frame(self, kind: Kind, body: dict[str, Any], now: float) -> None:
        if kind is Kind.HEARTBEAT_ACK:
            if self.beats:
                self.stats.beat_rtt.append(now - self.beats.popleft())
            self.stats.stops += len(body.get("stop", []))
        elif kind is Kind.PREPARE_RENDEZVOUS:
            self.stats.prepared[str(body["job"])] = now
            ready = {"job": body["job"], "epoch": body["epoch"], "node_rank": 0}
            ready |= {"addr": self.inventory["advertise_address"], "port": 29500}
            self._spawn(self.send(Kind.RENDEZVOUS_READY, ready))
        elif kind is Kind.MASTER_CHECK:
            # The real agent dials node 0's held port and reads the job Python's versions.
            ids = {k: body.get(k) for k in ("job", "epoch", "node_rank")}
            found = {"error": None, "torch": self.inventory["torch_version"], "nccl": None}
            self._spawn(self.send(Kind.MASTER_CHECKED, {**ids, **found}))
        elif kind is Kind.ASSIGN:
            job = str(body["job"])
            self.stats.assigned.setdefault(job, []).append(now)
            ids = {"job": job, "epoch": body["epoch"], "node_rank": body["node_rank"]}
            self.members[job] = asyncio.create_task(self._member(ids))
        elif kind is Kind.STOP:
            self.stats.stops += 1
            task = self.members.pop(str(body.get("job")), None)
            if task is not None:
                task.cancel()
                ids = {k: body.get(k) for k in ("job", "epoch", "node_rank")}
                stopped = {**ids, "exit_code": 143, "signal": "SIGTERM"}
                self._spawn(self.send(Kind.MEMBER_EXITED, stopped))
        elif kind is Kind.ERROR:
            self.stats.errors.append(f"{self.id}: {body.get('message')}")

    def _spawn(self, coro: Any) -> None:
        self.tasks.append(asyncio.create_task(coro))
        self.tasks = [t for t in self.tasks if not t.done()]

    async def _member(self, ids: dict[str, Any]) -> None:
        await self.send(Kind.MEMBER_STARTED, {**ids, "pid": 4242})
        await asyncio.sleep(self.run_time)
        exited = {"exit_code": 0, "signal": None, "failed_rank": None, "tail": []}
        await self.send(Kind.MEMBER_EXITED, {**ids, **exited})
        await self.send(Kind.ARTIFACTS_DONE, {**ids, "files": [], "errors": []})
        self.members.pop(str(ids["job"]), None)
        self.stats.members_done += 1
        await self.send_inventory()  # every process of the member is gone

    async def close(self) -> None:
        self.stopping = True
        self.stats.beats_unanswered += sum(
            1 for t in self.beats if time.monotonic() - t > self.interval
        )
        for task in [*self.tasks, *self.members.values()]:
            task.cancel()
        if self.ws is not None:
            await self.ws.close()


async def simulate(url: str, secret: str, count: int, run_time: float, conn: Connection) -> None:
    stats = AgentStats()
    agents = [SimAgent(i, url, secret, run_time, stats) for i in range(count)]
    started = time.monotonic()
    gate = asyncio.Semaphore(32)
    await asyncio.gather(*(a.connect(gate) for a in agents))
    conn.send(("connected", time.monotonic() - started))
    loop = asyncio.get_running_loop()
    while True:
        order = await loop.run_in_executor(None, conn.recv)
        if order == "inventory":
            released = time.monotonic()
            await asyncio.gather(*(a.send_inventory() for a in agents))
            conn.send(("released", released))
        elif order == "stop":
            break
    await asyncio.gather(*(a.close() for a in agents), return_exceptions=True)
    conn.send(("stats", stats))


def agents_process(url: str, secret: str, count: int, run_time: float, conn: Connection) -> None:
    asyncio.run(simulate(url, secret, count, run_time, conn))


# ---- the user side: submitters, a reader, /metrics ----------------------------------------


class Reader(threading.Thread):
    """A dashboard-like reader: GET /v1/jobs, then one job's GET /v1/jobs/{id}, ~10/s."""

    def __init__(self, url: str, token: str, job_ids: list[str]) -> None:
        super().__init__(daemon=True)
        self.http = Client(url, token).http
        self.job_ids = job_ids  # appended to by the submitters
        self.times: dict[str, list[tuple[float, float]]] = {"list": [], "describe": []}
        self.states: dict[str, str] = {}
        self.largest = 0  # bytes of the largest answer
        self.halt = threading.Event()

    def timed(self, kind: str, path: str) -> httpx.Response:
        t0 = time.monotonic()
        response = self.http.get(path)
        self.times[kind].append((t0, time.monotonic() - t0))
        self.largest = max(self.largest, len(response.content))
        response.raise_for_status()
        return response

    def run(self) -> None:
        rnd = random.Random(7)
        while not self.halt.wait(0.1):
            listing = self.timed("list", "/v1/jobs").json()
            self.states = {j["id"]: j["state"] for j in listing}
            if self.job_ids:
                self.timed("describe", f"/v1/jobs/{rnd.choice(self.job_ids)}")


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of a process so far (Linux /proc; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def scrape(http: httpx.Client) -> str:
    return http.get("/metrics").text


def sample(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def histogram_quantiles(text: str, name: str, qs: list[float]) -> tuple[list[float], int, float]:
    """Quantiles of a Prometheus histogram, interpolated in-bucket (histogram_quantile)."""
    buckets = [
        (float("inf") if le == "+Inf" else float(le), float(v))
        for le, v in re.findall(rf'^{name}_bucket{{le="([^"]+)"}} (\S+)$', text, re.M)
    ]
    total = buckets[-1][1] if buckets else 0.0
    out = []
    for q in qs:
        rank, lower, below = q * total, 0.0, 0.0
        value = float("nan")
        for upper, count in buckets:
            if count >= rank and total:
                inside = count - below
                value = upper if upper == float("inf") else lower
                if upper != float("inf") and inside:
                    value = lower + (upper - lower) * (rank - below) / inside
                break
            lower, below = upper, count
        out.append(value)
    return out, int(total), sample(text, f"{name}_sum")


# ---- one run --------------------------------------------------------------------------------


@dataclass
class RunResult:
    submit_rate: float
    placed_rate: float
    placed: int
    pass_p50: float
    pass_p99: float
    passes_observed: int
    list_p99: float
    describe_p99: float
    frame_p99: float
    beats_late: int
    beats_missed: int
    lost: int
    failed: int


def run_once(db: str | None, args: argparse.Namespace, specs: list[dict[str, Any]]) -> RunResult:
    with LocalCluster(agents=0, db=db) as cluster:
        token, secret = cluster.token(), split_token(cluster.join_token())[0]
        ws_url = cluster.url.replace("http", "ws", 1) + "/v1/agents/link"
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        sim = context.Process(
            target=agents_process,
            args=(ws_url, secret, args.agents, args.run_time, theirs),
            daemon=True,
        )
        sim.start()
        try:
            return drive(cluster, db, args, specs, token, ours, sim.pid)
        finally:
            sim.join(30)
            if sim.is_alive():
                sim.kill()


def drive(
    cluster: LocalCluster,
    db: str | None,
    args: argparse.Namespace,
    specs: list[dict[str, Any]],
    token: str,
    agents: Connection,
    agents_pid: int | None,
) -> RunResult:
    if not agents.poll(120):
        raise RuntimeError("the simulated agents did not connect within 120 s")
    _, connect_s = agents.recv()
    print(f"  {args.agents} agents connected in {connect_s:.1f} s")
    probe = Client(cluster.url, token).http
    released = 0.0
    if args.live:
        agents.send("inventory")
        released = agents.recv()[1]
        while sum(w["state"] == "idle" for w in cluster.client().workers()) < args.agents:
            time.sleep(0.2)

    job_ids: list[str] = []
    size: dict[str, int] = {}
    submitted: dict[str, float] = {}
    local = threading.local()

    def submit(spec: dict[str, Any]) -> None:
        if not hasattr(local, "api"):
            local.api = Client(cluster.url, token)
        t0 = time.monotonic()
        job_id = local.api.submit(spec, None)["id"]
        submitted[job_id] = t0
        size[job_id] = spec["distributed"]["num_workers"]
        job_ids.append(job_id)

    reader = Reader(cluster.url, token, job_ids)
    reader.start()
    first_submit = time.monotonic()
    with ThreadPoolExecutor(args.submitters) as pool:
        list(pool.map(submit, specs))
    submit_s = time.monotonic() - first_submit
    queued = sum(j["state"] == "queued" for j in cluster.client().jobs())
    print(f"  submitted {len(specs)} jobs in {submit_s:.1f} s ({queued} queued right after)")
    if not args.live:
        agents.send("inventory")
        released = agents.recv()[1]
    start = first_submit if args.live else released
    server_pid = cluster.procs["server"].pid
    cpu_before = cpu_seconds(server_pid), cpu_seconds(agents_pid)

    min_connected = float(args.agents)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        text = scrape(probe)
        min_connected = min(min_connected, sample(text, "muster_agents_connected"))
        done = sum(sample(text, "muster_jobs", f'{{state="{s}"}}') for s in TERMINAL)
        if done >= len(specs):
            break
        time.sleep(0.5)
    drained_s = time.monotonic() - start
    busy = [
        (cpu_seconds(pid) - before) / drained_s
        for pid, before in zip((server_pid, agents_pid), cpu_before, strict=True)
    ]
    reader.halt.set()
    reader.join(30)
    text = scrape(probe)
    workers = cluster.client().workers()
    store = open_store(db)
    events = Counter(e.kind for e in store.events())
    store.db.dispose()
    agents.send("stop")
    stats: AgentStats = agents.recv()[1]

    all_assigned = {
        job: max(times) for job, times in stats.assigned.items() if len(times) == size.get(job)
    }
    last = max(all_assigned.values(), default=start)
    placed_rate = len(all_assigned) / (last - start) if all_assigned else 0.0
    frame_path = [all_assigned[j] - stats.prepared[j] for j in all_assigned if j in stats.prepared]
    (r50, r99), reserved, _sum = histogram_quantiles(text, "muster_placement_seconds", [0.5, 0.99])
    # The goal's measure: whole passes over a non-empty queue (the controller's own histogram,
    # finer buckets); reservations are printed too.
    (p50, p99), passes, _sum = histogram_quantiles(
        text, "muster_scheduler_pass_seconds", [0.5, 0.99]
    )
    phases = {"while submitting": lambda t0: t0 < start, "while draining": lambda t0: t0 >= start}
    reads = {kind: [dt for _, dt in times] for kind, times in reader.times.items()}
    failed = sum(1 for s in reader.states.values() if s in ("failed", "cancelled"))
    failed = max(failed, int(sample(text, "muster_jobs", '{state="failed"}')))
    offline = [w["id"] for w in workers if not w["connected"] or w["state"] == "offline"]
    late = sum(1 for rtt in stats.beat_rtt if rtt > stats.interval)
    lost = max(
        events["WorkerLost"], len(stats.closed), len(offline), args.agents - int(min_connected)
    )

    print(
        f"  drained in {drained_s:.1f} s; {len(all_assigned)} of {len(specs)} gangs had every "
        f"member assigned, {failed} failed; members done {stats.members_done}; CPU while "
        f"draining: controller {busy[0]:.0%} of a core, simulated agents {busy[1]:.0%}"
    )
    print(
        f"  submit -> queued: {len(specs) / submit_s:,.0f} jobs/s; gangs placed (every "
        f"ASSIGN in) {placed_rate:,.0f}/s; node0's PREPARE -> last ASSIGN "
        f"p50 {pct(frame_path, 0.5) * 1e3:.0f} ms, p99 {pct(frame_path, 0.99) * 1e3:.0f} ms"
    )
    print(
        f"  muster_scheduler_pass_seconds (whole passes, {passes}): p50 {p50 * 1e3:.1f} ms, "
        f"p99 {p99 * 1e3:.1f} ms; muster_placement_seconds (pass start -> each reservation, "
        f"{reserved} gangs): p50 {r50 * 1e3:.1f} ms, p99 {r99 * 1e3:.1f} ms"
    )
    for phase, within in phases.items():
        got = {k: [dt for t0, dt in v if within(t0)] for k, v in reader.times.items()}
        if got["list"]:
            print(
                f"  reads {phase}: GET /v1/jobs p50 {pct(got['list'], 0.5) * 1e3:.0f} ms "
                f"p99 {pct(got['list'], 0.99) * 1e3:.0f} ms ({len(got['list'])}); "
                f"GET /v1/jobs/{{id}} p50 {pct(got['describe'], 0.5) * 1e3:.0f} ms "
                f"p99 {pct(got['describe'], 0.99) * 1e3:.0f} ms ({len(got['describe'])})"
            )
    print(
        f"  heartbeats: {stats.beats_sent} sent, ack p99 {pct(stats.beat_rtt, 0.99) * 1e3:.0f} ms "
        f"max {max(stats.beat_rtt, default=0) * 1e3:.0f} ms, {late} acked after more than "
        f"the {stats.interval:.0f} s interval, "
        f"{stats.beats_unanswered} never acked; longest gap between our beats "
        f"{stats.max_beat_gap:.1f} s"
    )
    print(
        f"  agents lost: {events['WorkerLost']} WorkerLost events, {len(stats.closed)} links "
        f"closed by the controller, {len(offline)} offline, min muster_agents_connected "
        f"{min_connected:.0f}; STOPs {stats.stops}, ERRORs {len(stats.errors)}"
    )
    print(
        f"  events stored: {events.total():,} ("
        + ", ".join(f"{kind} {n:,}" for kind, n in events.most_common(4))
        + f"); largest GET /v1/jobs answer {reader.largest / 1e6:.1f} MB"
    )
    for line in (stats.closed + stats.errors)[:5]:
        print(f"    {line}")
    return RunResult(
        submit_rate=len(specs) / submit_s,
        placed_rate=placed_rate,
        placed=len(all_assigned),
        pass_p50=p50,
        pass_p99=p99,
        passes_observed=passes,
        list_p99=pct(reads["list"], 0.99),
        describe_p99=pct(reads["describe"], 0.99),
        frame_p99=pct(frame_path, 0.99),
        beats_late=late,
        beats_missed=stats.beats_unanswered,
        lost=lost,
        failed=failed,
    )


# ---- the anchor -----------------------------------------------------------------------------


def decision_anchor(specs: list[dict[str, Any]], workers: int, repeat: int = 5) -> float:
    """Seconds for one pure scheduler pass: 1,000 queued jobs, the idle pool, no I/O."""
    jobs = [QueuedJob(f"j{i}", parse_job(s), i) for i, s in enumerate(specs)]
    views = [WorkerView(inventory=inventory(i)) for i in range(workers)]
    times, placed = [], 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        decisions = schedule(jobs, PoolIndex(views), frozenset({PathClass.PRIVATE}))
        times.append(time.perf_counter() - t0)
        placed = sum(isinstance(d.outcome, Placement) for d in decisions)
    median = statistics.median(times)
    print(
        f"anchor: schedule() over {len(jobs)} queued jobs and {workers} idle workers, no I/O: "
        f"{median * 1e3:.1f} ms a pass (median of {repeat}), {placed} gangs placed"
    )
    return median


def engine(
    name: str,
    make_db: Callable[[int], str | None],
    args: argparse.Namespace,
    specs: list[dict[str, Any]],
    anchor: float,
) -> None:
    results = []
    for i in range(args.repeat):
        print(f"{name}, run {i + 1} of {args.repeat}:")
        results.append(run_once(make_db(i), args, specs))

    def med(get: Callable[[RunResult], float]) -> float:
        return statistics.median(get(r) for r in results)

    placed, pass_p99 = med(lambda r: r.placed_rate), med(lambda r: r.pass_p99)
    read_p99 = med(lambda r: max(r.list_p99, r.describe_p99))
    lost = max(r.lost for r in results)
    print(
        f"{name} (median of {len(results)}): submit {med(lambda r: r.submit_rate):,.0f} jobs/s; "
        f"placed {placed:,.0f} gangs/s; pass p50 {med(lambda r: r.pass_p50) * 1e3:.1f} ms, "
        f"p99 {pass_p99 * 1e3:.1f} ms = {pass_p99 / anchor:.1f}x the no-I/O pass "
        f"({anchor * 1e3:.1f} ms); API read p99 {read_p99 * 1e3:.0f} ms; "
        f"agents falsely lost {lost}; heartbeats late {max(r.beats_late for r in results)}"
    )
    for goal, met in (
        (">= 500 gangs placed/s", placed >= 500),
        ("pass p99 < 100 ms", pass_p99 < 0.1),
        ("API read p99 < 50 ms", read_p99 < 0.05),
        ("0 agents falsely lost", lost == 0),
    ):
        print(f"  goal {goal}: {'met' if met else 'NOT met'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=200)
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--run-time", type=float, default=0.05, help="seconds a member runs")
    parser.add_argument("--submitters", type=int, default=4, help="threads submitting jobs")
    parser.add_argument("--timeout", type=float, default=150, help="seconds to drain the queue")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="50 agents, 200 jobs")
    parser.add_argument("--live", action="store_true", help="agents idle before the submits")
    parser.add_argument("--no-postgres", action="store_true")
    parser.add_argument("--seed", type=int, default=int(os.environ.get("MUSTER_BENCH_SEED", 1)))
    args = parser.parse_args()
    if args.quick:
        args.agents, args.jobs = min(args.agents, 50), min(args.jobs, 200)
    specs = job_specs(args.jobs, random.Random(args.seed))
    mean = statistics.mean(s["distributed"]["num_workers"] for s in specs)
    print(
        f"seed {args.seed}: {args.agents} agents, {args.jobs} gangs of 2-8 (mean "
        f"{mean:.1f}), members run {args.run_time * 1e3:.0f} ms: at most "
        f"~{args.agents / mean / args.run_time:,.0f} gangs/s could turn over"
    )
    anchor = decision_anchor(specs, args.agents)
    with tempfile.TemporaryDirectory(prefix="muster-bench-") as tmp:
        engine("sqlite", lambda i: f"{tmp}/run{i}.db", args, specs, anchor)
    if args.no_postgres:
        return
    from tests.pg import start_postgres

    server, why_not = start_postgres()
    if server is None:
        print(f"postgresql skipped: {why_not}")
        return
    try:
        engine(
            "postgresql",
            lambda i: server.create_database(f"cp_{uuid.uuid4().hex[:10]}"),
            args,
            specs,
            anchor,
        )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
