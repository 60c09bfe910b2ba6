"""The controller's supervision: scheduler passes, and a thin shell around ``muster.gang``.

Every decision about a gang run is ``muster.gang.step``'s (events in, actions out). This
module turns what happens into events (frames from agents, read by ``controller.frames``;
links that come and go, the clock, the API, a restart) and applies the actions in order:
store writes and frames. It decides nothing itself, apart from two things that are not
about a run:

- which queued jobs to place (``controller.placer``: ``muster.scheduler.schedule`` in one
  pass under the lock);
- what to tell an agent that reports members of jobs this controller no longer tracks
  (stop them; its worker stays busy until they are gone).

A restart rebuilds the runs of the jobs caught mid-run from the store and holds them for a
grace (a multiple of the heartbeat timeout): agents that dial back report their members
and the jobs go on; a member that does not come back within the grace fails its job.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

from muster.controller.auth import Tickets
from muster.controller.frames import member_event, member_report
from muster.controller.ingest import LogIngest
from muster.controller.links import CLOSE_REFUSED, Link, LinkEnded
from muster.controller.metrics import Metrics
from muster.controller.placer import Placer
from muster.controller.relays import RelayUsage
from muster.controller.runs import JoinKeys, RunEntry, rebuild_run
from muster.controller.stacks import StackDesk
from muster.controller.windows import WindowDesk
from muster.controller.writer import StoreWriter
from muster.errors import BadRequest, IllegalTransition, InfrastructureError
from muster.gang import (
    Action,
    Cancel,
    CaptureStacks,
    ControllerRestarted,
    Event,
    KeepApart,
    LinkBack,
    LinkLost,
    OutputsStored,
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
    Tick,
    step,
)
from muster.gang.network import probe_budget
from muster.net.relaywire import issue_ticket
from muster.plan import (
    MESH_GANGS,
    MESH_PREFIX,
    gang_addressing,
    mesh_address,
    mesh_mtu,
)
from muster.scheduler import Placement
from muster.spec import (
    JobSpec,
    JobState,
    MemberState,
    PathClass,
    WorkerInventory,
    WorkerState,
)
from muster.store import Store
from muster.store.writes import (
    ConditionWrite,
    EventWrite,
    InventoryWrite,
    JobStateWrite,
    MemberStateWrite,
    ReleaseWrite,
    RendezvousWrite,
    WorkerStateWrite,
    Write,
)
from muster.wire import Frame, Kind, open_worker_id

log = logging.getLogger("muster.controller")
T = TypeVar("T")

# The path classes this controller sets up; relayed too once it knows relays (`muster server
# --relay`). A gang that would need one it does not waits, saying so.
SUPPORTED_PATHS = frozenset({PathClass.PRIVATE, PathClass.DIRECT})
RELAY_TICKETS = 8  # per member and relay in NET_PEERS: each admits one (re)dial
RELAY_DEFAULT_GBPS = 1.0  # a relayed gang's cap when its spec names none
RELAY_TICKETS_EVERY_S = 5.0  # a member's RELAY_TICKETS is answered at most this often
RESTART_GRACE_HEARTBEATS = 3  # after a restart, runs wait this many heartbeat timeouts
_SENDS = (
    SendNetSetup,
    SendNetPeers,
    SendProbeListen,
    SendProbeRun,
    SendMasterCheck,
    SendPrepareRendezvous,
    SendAssign,
    SendStop,
)
PASS_GATHER_S = 0.01  # a pass waits this long after the first request, to take the others
PASS_GATHER_MOST_S = 0.2
IDLE_PASS_EVERY_S = 5.0  # with nothing asked, a pass (why-pending, gauges) this often
OPEN_LINKS_MAX = 256  # links admitted without the join secret (open_admission), all jobs
OPEN_HOST = re.compile(r"[A-Za-z0-9._-]{1,63}")
# An open link that has not walked in (sent its INVENTORY) by then is closed.
OPEN_ADMIT_S = 30.0


class Controller:
    def __init__(
        self,
        store: Store,
        metrics: Metrics,
        heartbeat_timeout: float,
        tickets: Tickets,
        restart_grace: float | None = None,
    ) -> None:
        self.store = store
        self.tickets = tickets
        self.metrics = metrics
        self.heartbeat_timeout = heartbeat_timeout
        self.restart_grace = restart_grace or RESTART_GRACE_HEARTBEATS * heartbeat_timeout
        self.links: dict[str, Link] = {}
        self.runs: dict[str, RunEntry] = {}
        self.lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self.logs = LogIngest(store, metrics)
        self.writer = StoreWriter(store, metrics, self._flushed)
        self._recording: set[str] = set()  # workers whose INVENTORY write is not committed
        # Pairs of workers each job's gangs must not hold together, per path (KeepApart of
        # its fenced epochs); restored from their EpochFenced events after a restart.
        self._apart: dict[str, dict[PathClass, frozenset[frozenset[str]]]] = {}
        # The MTU each job's next direct gangs take at most (SmallerPackets of its fenced
        # epochs); restored from their EpochFenced events after a restart, as _apart is.
        self._packets: dict[str, int] = {}
        self._pass_wanted = True
        self.last_pass_took = 0.0
        self._consumers: dict[str, asyncio.Task[None]] = {}  # worker id -> its link's consumer
        self.exiting = False  # set when the controller stops: links going down lose nobody
        self._closing: set[asyncio.Task[None]] = set()
        self.supported_paths = SUPPORTED_PATHS
        self.relays: tuple[tuple[str, int], ...] = ()  # muster relays the relayed path uses
        self.relay_secret = b""  # shared with them: the tickets' MAC key
        self.relay_max_gbps = RELAY_DEFAULT_GBPS  # the most a relayed gang may ask for
        self._tickets_sent: dict[tuple[str, int], float] = {}  # (job, node) -> last answer
        self.placer = Placer(self)  # the scheduler passes
        self.windows = WindowDesk(self)  # join windows of membership: window jobs
        self.stacks = StackDesk(self)  # muster stacks: the ranks' Python stacks
        self.relay_usage = RelayUsage(self)  # what relayed gangs sent (muster usage)

    async def db(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a store call off the event loop."""
        return await asyncio.to_thread(fn, *args, **kwargs)

    def request_pass(self) -> None:
        self._pass_wanted = True
        self._wake.set()

    def runs_bundle(self, worker_id: str, sha256: str) -> bool:
        """Whether the worker is placed in a job (not yet over) whose bundle is ``sha256``."""
        return any(
            entry.bundle == sha256 and worker_id in entry.gang.workers and not entry.gang.is_over
            for entry in self.runs.values()
        )

    def may_upload(self, worker_id: str, job_id: str, node: int) -> bool:
        """Whether the worker is node ``node`` of the job's tracked run and that member's
        outputs have not been reported yet (no upload over a finished job's outputs)."""
        entry = self.runs.get(job_id)
        if entry is None or entry.gang.node_of(worker_id) != node:
            return False
        return entry.gang.members[node].outputs is None

    # ---- the shell: step, then apply ----------------------------------------------------

    async def _step(self, entry: RunEntry, event: Event) -> asyncio.Future[None]:
        """Step the run and apply what it decided; a send that finds no link becomes a
        LinkLost for that worker once the rest of the batch is applied. Returns the future
        of the step's store writes (done once they are committed)."""
        entry.gang, actions = step(entry.gang, event, time.time())
        lost, written = await self._apply(entry, actions)
        for worker, why in lost:
            entry.gang, actions = step(entry.gang, LinkLost(worker, why), time.time())
            _more_lost, written = await self._apply(entry, actions)
        if entry.gang.settled and self.runs.get(entry.gang.job) is entry:
            del self.runs[entry.gang.job]
            self.request_pass()
        return written

    async def _apply(
        self, entry: RunEntry, actions: Sequence[Action]
    ) -> tuple[list[tuple[str, str]], asyncio.Future[None]]:
        """The step's store writes go to the group commit; frames go out after them. ASSIGN
        waits until the writes are committed: a member that may run is on record first (a
        restart rebuilds from it)."""
        run = entry.gang
        job, epoch = run.job, run.epoch
        lost: list[tuple[str, str]] = []
        writes: list[Write] = []
        for action in actions:
            if isinstance(action, SetJobState):
                writes.append(JobStateWrite(job, action.state, action.reason))
            elif isinstance(action, SetMemberState):
                address = None
                if action.state is MemberState.ASSIGNED and entry.addressing is not None:
                    address = entry.addressing.addresses[action.node]
                writes.append(
                    MemberStateWrite(
                        job, action.node, action.state, action.exit_code, action.signal, address
                    )
                )
            elif isinstance(action, RecordEvent):
                data = dict(action.data)
                writes.append(EventWrite(action.kind, action.message, job, action.worker, data))
            elif isinstance(action, ReleaseWorker):
                writes.append(ReleaseWrite(action.worker, job))
            elif isinstance(action, KeepApart):
                self._keep_apart(job, action.path, action.pairs)
            elif isinstance(action, SmallerPackets):
                self._packets[job] = min(action.mtu, self._packets.get(job, action.mtu))
            elif isinstance(action, CaptureStacks):
                self.stacks.capture_later(job, action.episode)
            elif isinstance(action, SetCondition):
                writes.append(
                    ConditionWrite(job, action.type, action.status, action.reason, action.message)
                )
            elif isinstance(action, SetRendezvous):
                writes.append(RendezvousWrite(job, epoch, action.addr, action.port))
                entry.addressing = gang_addressing(
                    entry.gang.path or PathClass.PRIVATE,
                    entry.inventories,
                    action.port,
                    entry.mesh,
                )
        written = self.writer.submit(writes)
        sends = [a for a in actions if isinstance(a, _SENDS)]
        if any(isinstance(a, SendAssign) for a in sends):
            # Only ASSIGN starts processes. (A PREPARE sent before its job's state is on
            # record is harmless: after a restart node 0 is simply asked again.)
            await written

        async def send(worker: str, kind: Kind, body: dict[str, Any]) -> None:
            link = self.links.get(worker)
            if link is None or not await link.send(kind, body):
                lost.append((worker, f"it had no control link when {kind.name} was sent"))

        for action in sends:
            if isinstance(action, SendNetSetup) and run.path is PathClass.RELAYED:
                if entry.join_keys is None or entry.join_keys.epoch != epoch:
                    entry.join_keys = JoinKeys(epoch)
                setup = {
                    "job": job,
                    "epoch": epoch,
                    "node_rank": action.node,
                    "path": PathClass.RELAYED.value,
                    "join_key": entry.join_keys.issue(action.node),
                }
                await send(action.worker, Kind.NET_SETUP, setup)
            elif isinstance(action, SendNetSetup):
                if entry.join_keys is None or entry.join_keys.epoch != epoch:
                    entry.join_keys = JoinKeys(epoch)
                cap = self._packets.get(job)
                offered = mesh_mtu(entry.inventories)
                entry.offered_mtu = offered if cap is None else min(offered, cap)
                setup = {
                    "job": job,
                    "epoch": epoch,
                    "node_rank": action.node,
                    "address": mesh_address(action.node, entry.mesh),
                    "prefix": MESH_PREFIX,
                    "mtu": entry.offered_mtu,
                    "join_key": entry.join_keys.issue(action.node),
                }
                await send(action.worker, Kind.NET_SETUP, setup)
            elif isinstance(action, SendNetPeers) and run.path is PathClass.RELAYED:
                await send(action.worker, Kind.NET_PEERS, self._relayed_peers(entry, action))
            elif isinstance(action, SendNetPeers):
                peers = [
                    {
                        "node": node,
                        "public_key": key,
                        "endpoint": endpoint,
                        "address": mesh_address(node, entry.mesh),
                    }
                    for node, key, endpoint in action.peers
                ]
                order = {"job": job, "epoch": epoch, "node_rank": action.node, "peers": peers}
                if self.relays:  # a pair that loses its path goes on through them
                    order["gang"] = f"{job}/{epoch}"
                    order["relays"] = self._relay_list(entry, action.node)
                await send(action.worker, Kind.NET_PEERS, order)
            elif isinstance(action, SendProbeListen):
                where = self._path_addresses(entry)[action.node]
                order = {
                    "job": job,
                    "epoch": epoch,
                    "node_rank": action.node,
                    "addr": where,
                    "for": probe_budget(run),  # the listener's lifetime
                    "token": entry.probe_token,  # only the gang's members are answered
                }
                await send(action.worker, Kind.PROBE_LISTEN, order)
            elif isinstance(action, SendProbeRun):
                addresses = self._path_addresses(entry)
                order = {
                    "job": job,
                    "epoch": epoch,
                    "node_rank": action.node,
                    "seconds": action.seconds,
                    "token": entry.probe_token,
                    "peers": [
                        {"node": node, "addr": addresses[node], "port": port}
                        for node, port in action.peers
                    ],
                }
                await send(action.worker, Kind.PROBE_RUN, order)
            elif isinstance(action, SendMasterCheck):
                order = {
                    "job": job,
                    "epoch": epoch,
                    "node_rank": action.node,
                    "addr": action.addr,
                    "port": action.port,
                }
                await send(action.worker, Kind.MASTER_CHECK, order)
            elif isinstance(action, SendPrepareRendezvous):
                body = {"job": job, "epoch": epoch, "addr": action.addr, "port": action.port}
                await send(action.worker, Kind.PREPARE_RENDEZVOUS, body)
            elif isinstance(action, SendAssign):
                await send(action.worker, Kind.ASSIGN, self._assignment(entry, action.node))
            elif isinstance(action, SendStop):
                link = self.links.get(action.worker)
                if link is not None:  # a worker without a link is lost already
                    order = {
                        "job": job,
                        "epoch": epoch,
                        "node_rank": run.node_of(action.worker),
                        "reason": action.reason,
                    }
                    await link.send(Kind.STOP, order)
        return lost, written

    def _keep_apart(self, job: str, path: PathClass, pairs: Iterable[tuple[str, str]]) -> None:
        kept = self._apart.setdefault(job, {})
        kept[path] = kept.get(path, frozenset()) | {frozenset(pair) for pair in pairs}

    def _forget_fences(self, job: str) -> None:
        """The job is over: what its fenced epochs asked of its next gangs goes."""
        self._apart.pop(job, None)
        self._packets.pop(job, None)

    def _flushed(self, writes: Sequence[Write]) -> None:
        """After a commit: a worker freed or a job ended is room for the queue (and an
        ended job's kept-apart pairs are forgotten)."""
        for w in writes:
            if isinstance(w, JobStateWrite) and w.state.is_terminal:
                self._forget_fences(w.job)
        if any(
            isinstance(w, ReleaseWrite) or (isinstance(w, JobStateWrite) and w.state.is_terminal)
            for w in writes
        ):
            self.request_pass()

    def _assignment(self, entry: RunEntry, node: int) -> dict[str, Any]:
        addressing = entry.addressing
        if addressing is None:  # step assigns only after SetRendezvous: a bug if reached
            raise IllegalTransition(f"job {entry.gang.job}: ASSIGN before node0 published")
        return {
            "job": entry.gang.job,
            "epoch": entry.gang.epoch,
            "node_rank": node,
            "spec": entry.spec.model_dump(mode="json"),
            "path": addressing.path.value,
            "addresses": list(addressing.addresses),
            "interfaces": list(addressing.interfaces),
            "master_port": addressing.master_port,
            "bundle": entry.bundle,
        }

    # ---- the supervision loop ------------------------------------------------------------

    async def supervise(self, tick: float = 0.5) -> None:
        """Scheduler passes when asked (and every tick), stale links, the runs' clock.

        Runs for the controller's life: a step that fails is logged with its traceback,
        counted in muster_internal_errors_total{loop="supervise"}, and the loop goes on.
        """
        last_pass = last_tick = 0.0
        pass_took = 0.0
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), tick)
            if self._wake.is_set():
                # Let the requests of a burst gather into one pass; a pass waits at least
                # as long as the last one took, so passes never take more than about half
                # of the controller while frames wait (each pass places all it can).
                await asyncio.sleep(min(max(PASS_GATHER_S, pass_took), PASS_GATHER_MOST_S))
            self._wake.clear()
            now = time.monotonic()
            parts: list[Callable[[], Awaitable[None]]] = []
            if now - last_tick >= tick:
                last_tick = now
                parts += [self._check_links, self._tick_runs]
            if self._pass_wanted or now - last_pass > IDLE_PASS_EVERY_S:
                self._pass_wanted = False
                last_pass = now
                parts += [self._timed_pass, self._gauges]
            pass_took = self.last_pass_took
            for part in parts:
                try:
                    await part()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    self.metrics.internal_errors.labels("supervise").inc()
                    log.exception("supervision step %s failed; going on", part.__name__)

    async def _timed_pass(self) -> None:
        started = time.monotonic()
        try:
            await self.scheduler_pass()
        finally:
            self.last_pass_took = time.monotonic() - started

    async def _check_links(self) -> None:
        now = time.monotonic()
        for link in list(self.links.values()):
            if now - link.last_seen > self.heartbeat_timeout:
                await self.link_down(
                    link,
                    f"no heartbeat for {now - link.last_seen:.0f}s "
                    f"(timeout {self.heartbeat_timeout:.0f}s)",
                )
                # Closing a silent peer takes a moment: not in the supervision loop.
                self.close_later(link, 1011)
            elif link.open_job and not link.reported and now - link.opened_at > OPEN_ADMIT_S:
                log.warning(
                    "closing %s: admitted without the secret, it never walked in", link.worker_id
                )
                await self.link_down(link, "an open link that never walked in")
                self.close_later(link, CLOSE_REFUSED)

    def close_later(self, link: Link, code: int) -> None:
        """Close ``link`` in its own task: its flush may take a second, not under the lock."""
        task = asyncio.create_task(link.close(code))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _tick_runs(self) -> None:
        """Job timeouts and the grace after a restart are the runs' clock; a join window
        whose clock ran out gets a pass."""
        async with self.lock:
            for entry in list(self.runs.values()):
                await self._step(entry, Tick())
            if self.windows.due(time.time()):
                self.request_pass()

    def apart_of(self, job_id: str) -> dict[PathClass, frozenset[frozenset[str]]] | None:
        """The worker pairs this job's gangs must not hold together (fenced epochs)."""
        return self._apart.get(job_id)

    async def start_window(self, job_id: str) -> dict[str, Any]:
        """``muster start JOB``: fire the job's staging window (BadRequest says why not)."""
        async with self.lock:
            return await self.windows.start(job_id)

    async def window_view(self, job_id: str) -> dict[str, Any]:
        async with self.lock:
            return await self.windows.view(job_id)

    async def _gauges(self) -> None:
        self.metrics.agents.set(len(self.links))
        counts = await self.db(self.store.job_counts)
        for state in JobState:
            self.metrics.jobs.labels(state.value).set(counts.get(state.value, 0))

    # ---- placement -----------------------------------------------------------------------

    async def scheduler_pass(self) -> None:
        """One scheduler pass (the placer's), under the lock."""
        await self.placer.run_pass()

    async def start_placed(
        self, job_id: str, spec: JobSpec, outcome: Placement, epoch: int, bundle: str | None
    ) -> None:
        """A reserved gang starts its run (the lock held); see Placer.start_placed."""
        await self.placer.start_placed(job_id, spec, outcome, epoch, bundle)

    # ---- after a restart -----------------------------------------------------------------

    async def restore_runs(self) -> None:
        """Rebuild the runs of jobs caught mid-run and hold them for the grace; a job whose
        spec no longer validates fails at once."""
        apart, packets = await self.db(self.store.fenced_epochs)
        for job_id, pairs in apart.items():
            for path, a, b in pairs:
                with contextlib.suppress(ValueError):  # a path this version does not know
                    self._keep_apart(job_id, PathClass(path), [(a, b)])
        self._packets.update(packets)
        records = await self.db(self.store.active_runs)
        if not records:
            return
        views = {v.inventory.id: v.inventory for v in await self.db(self.store.workers)}
        now = time.time()
        async with self.lock:
            for rec in records:
                job_id = rec.job.id
                try:
                    entry = rebuild_run(rec, views)
                except (ValueError, KeyError) as exc:
                    await self.db(
                        self.store.set_job_state,
                        job_id,
                        JobState.FAILED,
                        f"the controller restarted and could not rebuild the run: {exc}",
                    )
                    self._forget_fences(job_id)
                    continue
                if job_id in self._packets:  # (as Placer.start_placed gives it)
                    entry.gang = dataclasses.replace(entry.gang, spare_epochs=1)
                self.runs[job_id] = entry
                self.logs.note_senders(job_id, [m.worker_id for m in rec.members])
                await self._step(entry, ControllerRestarted(now + self.restart_grace))
                log.info(
                    "job %s: held for %.0fs while its agents dial back",
                    job_id,
                    self.restart_grace,
                )

    # ---- frames from agents --------------------------------------------------------------

    async def on_frame(self, link: Link, frame: Frame) -> None:
        """Heartbeats are answered and logs queued at once; every other frame waits in the
        link's inbox for its consumer (and the lock), so a busy controller never leaves a
        heartbeat unread behind a member frame."""
        if frame.kind is Kind.HEARTBEAT:
            stops = [e.gang.job for e in self.runs.values() if e.gang.must_stop(link.worker_id)]
            await link.send(Kind.HEARTBEAT_ACK, {"stop": stops})
        elif frame.kind is Kind.LOGS:
            await self.logs.put(link, frame.body)
        elif frame.kind is Kind.STACKS_DONE:  # an answer someone waits for: not behind others
            self.stacks.reply(link.worker_id, frame.body)
        else:
            await link.inbox.put(frame)

    async def _consume(self, link: Link, after: asyncio.Task[None] | None) -> None:
        """The link's frames in their order, each under the lock; its end comes last. Runs
        until the link ends: a frame that fails is logged, counted and skipped."""
        if after is not None:  # the worker's previous link is handled to its end first
            with contextlib.suppress(Exception):
                await after
        while True:
            item = await link.inbox.get()
            if isinstance(item, LinkEnded):
                await self._link_ended(link, item)
                return
            try:
                if item.kind is Kind.INVENTORY:
                    async with self.lock:
                        recorded = await self._inventory(link, item.body)
                    if recorded is not None:
                        await recorded  # on record (outside the lock), then a pass
                    if link.walk_in:
                        self.windows.wanted = True  # its window (or its job's end) has news
                    self.request_pass()
                    continue
                async with self.lock:
                    written = await self._member_frame(link, item.kind, item.body)
                if item.kind in (Kind.MEMBER_EXITED, Kind.ARTIFACTS_DONE):
                    # Once on record (outside the lock: other links go on meanwhile), the
                    # agent may drop its copy of the report.
                    await written
                    ack = {k: item.body.get(k) for k in ("job", "epoch", "node_rank")}
                    await link.send(Kind.REPORT_ACK, {**ack, "report": int(item.kind)})
            except asyncio.CancelledError:
                raise
            except (KeyError, TypeError, ValueError) as exc:  # a MAC'd frame, bad body
                self.metrics.frames_refused.labels("malformed").inc()
                log.warning(
                    "worker %s: %s frame with a bad body: %r", link.worker_id, item.kind.name, exc
                )
            except Exception:
                self.metrics.internal_errors.labels("link").inc()
                log.exception(
                    "worker %s: handling %s failed; going on", link.worker_id, item.kind.name
                )

    async def _member_frame(
        self, link: Link, kind: Kind, body: dict[str, Any]
    ) -> asyncio.Future[None]:
        """Step the run the frame is about; returns the future of the writes it caused."""
        job = str(body.get("job"))
        entry = self.runs.get(job)
        nothing = self.writer.submit([])
        if entry is None or body.get("epoch") != entry.gang.epoch:
            if kind in (
                Kind.RENDEZVOUS_READY,
                Kind.MEMBER_STARTED,
                Kind.NET_READY,
                Kind.NET_UP,
                Kind.PROBE_READY,
                Kind.PROBE_DONE,
                Kind.MASTER_CHECKED,
            ):
                # (of that epoch only: the job's next epoch may be on this worker already)
                stale = {"job": job, "epoch": body.get("epoch"), "reason": "stale"}
                await link.send(Kind.STOP, stale)
            elif kind is Kind.MEMBER_EXITED:
                if entry is not None and entry.gang.node_of(link.worker_id) is not None:
                    # A fenced epoch's member (never started) answering its STOP late: the
                    # job's next epoch holds this worker now, and keeps it.
                    return nothing
                # The member of a run no longer tracked is gone: its worker is free.
                return self.writer.submit([ReleaseWrite(link.worker_id, job)])
            return nothing
        node = entry.gang.node_of(link.worker_id)
        if node is None or node != body.get("node_rank", node):
            return nothing
        if kind is Kind.NET_READY and not body.get("error"):
            # Joining the epoch's network takes its join key.
            keys = entry.join_keys or JoinKeys(entry.gang.epoch)
            refused = keys.redeem(node, body.get("join_key"))
            if refused is not None:
                self.metrics.frames_refused.labels("join_key").inc()
                log.warning("job %s: %s; refused", job, refused)
                why = f"{refused} (worker {link.worker_id}); its NET_READY was refused"
                return self.writer.submit(
                    [EventWrite("JoinRefused", why, job, link.worker_id, {"node": node})]
                )
        if kind is Kind.RELAY_TICKETS:
            # More relay tickets for this member of this epoch (at most one answer every
            # RELAY_TICKETS_EVERY_S per member: each ticket admits it once, to its gang only).
            key = (job, node)
            now = time.monotonic()
            if self.relays and now - self._tickets_sent.get(key, 0.0) >= RELAY_TICKETS_EVERY_S:
                if len(self._tickets_sent) > 10_000:  # (bounded: answers older than a minute)
                    self._tickets_sent = {
                        k: t for k, t in self._tickets_sent.items() if now - t < 60
                    }
                self._tickets_sent[key] = now
                await link.send(
                    Kind.RELAY_TICKETS_ISSUED,
                    {
                        "job": job,
                        "epoch": entry.gang.epoch,
                        "node_rank": node,
                        "relays": self._relay_list(entry, node),
                    },
                )
            return nothing
        event = member_event(entry, node, kind, body)
        if event is None:
            return nothing
        if isinstance(event, OutputsStored) and event.ok:
            # Remembered for a restart (GangRun.restore's outputs).
            stored = EventWrite(
                "OutputsStored",
                f"node{node} stored {len(body.get('files') or [])} output file(s)",
                job,
                data={"node": node, "epoch": entry.gang.epoch},
            )
            self.writer.submit([stored])
        return await self._step(entry, event)

    def _relay_list(self, entry: RunEntry, node: int) -> list[dict[str, Any]]:
        """The relays with single-use tickets admitting member ``node`` of the run's gang to
        each (muster.net.relaywire), at its share of the gang's rate."""
        gang = f"{entry.gang.job}/{entry.gang.epoch}"
        asked = entry.spec.gang.relay_gbps or RELAY_DEFAULT_GBPS
        gbps = min(asked, self.relay_max_gbps)
        rate = gbps * 1e9 / 8 / len(entry.gang.members)  # bytes/s, each member's share
        return [
            {
                "host": host,
                "port": port,
                "tickets": [
                    issue_ticket(self.relay_secret, gang, node, rate=rate)
                    for _ in range(RELAY_TICKETS)
                ],
            }
            for host, port in self.relays
        ]

    def _relayed_peers(self, entry: RunEntry, action: SendNetPeers) -> dict[str, Any]:
        """NET_PEERS of the relayed path: the peers' keys and addresses, the relays, and
        the member's tickets for them."""
        return {
            "job": entry.gang.job,
            "epoch": entry.gang.epoch,
            "node_rank": action.node,
            "path": PathClass.RELAYED.value,
            "gang": f"{entry.gang.job}/{entry.gang.epoch}",
            "addresses": list(self._path_addresses(entry)),
            "peers": [{"node": node, "public_key": key} for node, key, _ in action.peers],
            "relays": self._relay_list(entry, action.node),
        }

    def _path_addresses(self, entry: RunEntry) -> tuple[str, ...]:
        """Each node's address on the gang's path (what the ranks will use)."""
        path = entry.gang.path or PathClass.PRIVATE
        return gang_addressing(path, entry.inventories, 0, entry.mesh).addresses

    def _free_mesh(self) -> int:
        """The lowest mesh gang index no tracked direct run holds."""
        held = {e.mesh for e in self.runs.values() if e.gang.path is PathClass.DIRECT}
        for index in range(MESH_GANGS):
            if index not in held:
                return index
        raise InfrastructureError(f"all {MESH_GANGS} mesh networks of the direct path are in use")

    async def _inventory(self, link: Link, body: dict[str, Any]) -> asyncio.Future[None] | None:
        """Record the inventory (the lock held); returns the future of its commit."""
        inventory = WorkerInventory.model_validate(body["inventory"], strict=False)
        if inventory.id != link.worker_id:
            await link.send(Kind.ERROR, {"message": "inventory id differs from the link's"})
            return None
        if link.open_job is not None and (
            inventory.join is None or inventory.join.job != link.open_job
        ):
            # Admitted without the join secret to one window: it walks in there or nowhere.
            await link.send(
                Kind.ERROR,
                {"message": f"this link was admitted to job {link.open_job}'s window only"},
            )
            self.close_later(link, CLOSE_REFUSED)
            return None
        worker = link.worker_id
        link.walk_in = inventory.join is not None
        reports = tuple(member_report(r) for r in body.get("members") or [])
        # Members of jobs this controller does not track (or of an older epoch) that still
        # run are told to stop; the worker stays busy until an inventory without them.
        stale = [
            r
            for r in reports
            if r.exit_code is None
            and ((e := self.runs.get(r.job)) is None or e.gang.epoch != r.epoch)
        ]
        held_by = next(
            (
                e.gang.job
                for e in self.runs.values()
                if (n := e.gang.node_of(worker)) is not None and not e.gang.members[n].released
            ),
            None,
        )
        # Through the group commit, after anything queued before it (say, an OFFLINE);
        # the caller waits for it outside the lock, then asks for a pass.
        written = self.writer.submit(
            [InventoryWrite(inventory.model_dump(mode="json"), held_by, bool(stale))]
        )
        self._recording.add(worker)  # out of passes until the write lands (or fails)
        written.add_done_callback(lambda _done: self._recording.discard(worker))
        for report in stale:
            order = {"job": report.job, "epoch": report.epoch, "node_rank": report.node}
            await link.send(Kind.STOP, {**order, "reason": "the job is not running"})
        if not link.reported:
            # The first inventory of a link says what the agent still holds: the runs that
            # counted this worker lost (or unconfirmed after a restart) hear it is back.
            link.reported = True
            for entry in list(self.runs.values()):
                if worker in entry.gang.workers:
                    await self._step(entry, LinkBack(worker, reports))
        return written

    # ---- cancel, links -------------------------------------------------------------------

    async def step_job(self, job_id: str, event: Event) -> None:
        """Step a job's run with an event from the controller itself (StacksCaptured)."""
        async with self.lock:
            entry = self.runs.get(job_id)
            if entry is not None and not entry.gang.is_over:
                await self._step(entry, event)

    async def cancel(self, job_id: str) -> None:
        async with self.lock:
            await self.writer.barrier()  # a run that just ended is on record before we read
            job = await self.db(self.store.job, job_id)
            state = JobState(job.state)
            if state.is_terminal:
                raise BadRequest(f"job {job_id} already {state.value}; nothing to cancel")
            entry = self.runs.get(job_id)
            if entry is not None and entry.gang.fenced:
                entry = None  # its epoch ended; the job waits in the queue again
            if entry is not None and entry.gang.is_over:  # decided, not yet committed
                done = entry.gang.job_state.value
                raise BadRequest(f"job {job_id} already {done}; nothing to cancel")
            if entry is not None:
                written = await self._step(entry, Cancel("cancelled by the user"))
            else:
                await self.db(
                    self.store.set_job_state, job_id, JobState.CANCELLED, "cancelled by the user"
                )
                self._forget_fences(job_id)
                await self.windows.cancelled(job_id)
                return
        await written  # the caller reads the job back: the cancel is on record first

    def open_to(self, job: str, worker_id: str) -> str:
        """Why a walk-in without the join secret may not dial in to ``job`` ("" when it
        may): the job's window is open and has ``open_admission``, the worker id is one
        of that job's open ids, and there are fewer than OPEN_LINKS_MAX such links."""
        entry = self.windows.entries.get(job)
        window = entry.spec.gang.window if entry is not None else None
        if entry is None or window is None or not window.open_admission:
            return f"job {job} has no open join window with open_admission"
        if not entry.window.phase.open:
            return f"the join window of job {job} has closed"
        host = worker_id.removeprefix(open_worker_id(job, ""))
        if host == worker_id or not OPEN_HOST.fullmatch(host):
            return (
                f"an open walk-in to job {job} is named {open_worker_id(job, 'HOST')}, HOST "
                "being 1-63 of A-Z a-z 0-9 . _ -"
            )
        opened = [link for link in self.links.values() if link.open_job]
        rules = entry.window.rules
        per_job = 2 * max(rules.target or 0, rules.quorum) + 8
        if sum(1 for link in opened if link.open_job == job) >= per_job:
            return f"{per_job} boxes without the join secret are connected to job {job} already"
        if len(opened) >= OPEN_LINKS_MAX:
            return f"{OPEN_LINKS_MAX} boxes without the join secret are connected already"
        return ""

    async def link_up(self, link: Link) -> bool:
        """Register an authenticated link; False when that worker id is already connected."""
        if link.worker_id in self.links:
            return False
        self.links[link.worker_id] = link
        previous = self._consumers.get(link.worker_id)
        link.consumer = asyncio.create_task(self._consume(link, previous))
        self._consumers[link.worker_id] = link.consumer
        self.metrics.agents.set(len(self.links))
        return True

    async def link_down(self, link: Link, why: str, *, controller_exiting: bool = False) -> None:
        """The link's EOF (or silence) is the host's exit: its members are lost, once every
        frame it sent before has been handled (its consumer takes the end last)."""
        if self.links.get(link.worker_id) is not link:
            return
        controller_exiting = controller_exiting or self.exiting
        del self.links[link.worker_id]
        self.tickets.revoke(link.ticket)
        self.metrics.agents.set(len(self.links))
        link.abandon()
        await link.inbox.put(LinkEnded(why, controller_exiting))

    async def _link_ended(self, link: Link, end: LinkEnded) -> None:
        """When the controller itself is stopping, the runs are left as they are: the next
        start rebuilds them and waits for the agents to dial back (restore_runs)."""
        if self._consumers.get(link.worker_id) is link.consumer:
            del self._consumers[link.worker_id]
        self.windows.forget_link(link.worker_id)
        if end.controller_exiting:
            return
        why = end.why
        async with self.lock:
            await self.windows.left(link.worker_id)
            # The runs first: a store error below must not leave a lost member running.
            for entry in list(self.runs.values()):
                if link.worker_id in entry.gang.workers:
                    try:
                        await self._step(entry, LinkLost(link.worker_id, why))
                    except Exception:
                        self.metrics.internal_errors.labels("link").inc()
                        log.exception(
                            "job %s: handling the loss of %s failed", entry.gang.job, link.worker_id
                        )
            self.writer.submit(
                [
                    WorkerStateWrite(link.worker_id, WorkerState.OFFLINE),
                    EventWrite("WorkerLost", why, worker=link.worker_id),
                ]
            )
        self.request_pass()
