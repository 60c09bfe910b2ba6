"""The controller's supervision: scheduler passes, gated rendezvous, fail-fast (seed 001).

One gang run, as the controller drives it:

    reserve (one transaction) ─► PREPARE_RENDEZVOUS to node 0
      ─► node 0 publishes addr:port ─► ASSIGN to every member, node 0 first
      ─► every member started: job running
      ─► every member exited 0 and uploaded its outputs: job succeeded

The first member that exits non-zero, is lost, or outlives the job's timeout fails the job:
running members are told to STOP at once (and again on each heartbeat until they report
their exit), members never started are cancelled. Every state change goes through the
store; ``lock`` serializes the decisions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from muster.controller.auth import Tickets
from muster.controller.ingest import LogIngest
from muster.controller.links import Link
from muster.controller.metrics import Metrics
from muster.errors import BadRequest, PlacementConflict
from muster.plan import GangAddressing, gang_addressing
from muster.scheduler import Placement, PoolIndex, QueuedJob, schedule
from muster.spec import JobSpec, JobState, MemberState, PathClass, WorkerInventory, WorkerState
from muster.store import Store
from muster.wire import Frame, Kind

log = logging.getLogger("muster.controller")
T = TypeVar("T")

# The path classes this controller sets up. Direct (WireGuard) and relayed come with the
# gang networking issues; until then a gang that would need them waits, saying so.
SUPPORTED_PATHS = frozenset({PathClass.PRIVATE})


@dataclass
class GangRun:
    """What the controller tracks of one job's running epoch."""

    job_id: str
    epoch: int
    spec: JobSpec
    path: PathClass
    workers: list[str]  # node rank -> worker id
    inventories: list[WorkerInventory]
    bundle: str | None
    addressing: GangAddressing | None = None
    started: set[int] = field(default_factory=set)
    exited: dict[int, int] = field(default_factory=dict)
    uploaded: set[int] = field(default_factory=set)
    deadline: float | None = None
    over: bool = False  # the job reached a terminal state; members may still be stopping

    def node_of(self, worker_id: str) -> int | None:
        return self.workers.index(worker_id) if worker_id in self.workers else None


class Controller:
    def __init__(
        self, store: Store, metrics: Metrics, heartbeat_timeout: float, tickets: Tickets
    ) -> None:
        self.store = store
        self.tickets = tickets
        self.metrics = metrics
        self.heartbeat_timeout = heartbeat_timeout
        self.links: dict[str, Link] = {}
        self.runs: dict[str, GangRun] = {}
        self.lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self.logs = LogIngest(store, metrics)

    async def db(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a store call off the event loop."""
        return await asyncio.to_thread(fn, *args, **kwargs)

    def request_pass(self) -> None:
        self._wake.set()

    def runs_bundle(self, worker_id: str, sha256: str) -> bool:
        """Whether the worker is placed in a job (not yet over) whose bundle is ``sha256``."""
        return any(
            run.bundle == sha256 and worker_id in run.workers and not run.over
            for run in self.runs.values()
        )

    # ---- the supervision loop ------------------------------------------------------------

    async def supervise(self, tick: float = 0.5) -> None:
        """Scheduler passes when asked (and every tick), stale links, job timeouts.

        Runs for the controller's life: a step that fails is logged with its traceback,
        counted in muster_internal_errors_total{loop="supervise"}, and the loop goes on.
        """
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), tick)
            self._wake.clear()
            for step in (
                self._check_links,
                self._check_timeouts,
                self.scheduler_pass,
                self._update_gauges,
            ):
                try:
                    await step()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    self.metrics.internal_errors.labels("supervise").inc()
                    log.exception("supervision step %s failed; going on", step.__name__)

    async def _check_links(self) -> None:
        now = time.monotonic()
        for link in list(self.links.values()):
            if now - link.last_seen > self.heartbeat_timeout:
                await self.link_down(
                    link,
                    f"no heartbeat for {now - link.last_seen:.0f}s "
                    f"(timeout {self.heartbeat_timeout:.0f}s)",
                )
                await link.close(1011)

    async def _check_timeouts(self) -> None:
        now = time.monotonic()
        for run in list(self.runs.values()):
            if not run.over and run.deadline is not None and now > run.deadline:
                async with self.lock:
                    await self._fail(run, f"timed out after {run.spec.timeout}s (spec.timeout)")

    async def _update_gauges(self) -> None:
        self.metrics.agents.set(len(self.links))
        counts = await self.db(self.store.job_counts)
        for state in JobState:
            self.metrics.jobs.labels(state.value).set(counts.get(state.value, 0))

    # ---- placement -----------------------------------------------------------------------

    async def scheduler_pass(self) -> None:
        async with self.lock:
            started = time.perf_counter()
            queued = await self.db(self.store.jobs, [JobState.QUEUED])
            if not queued:
                return
            views = await self.db(self.store.workers)
            jobs = []
            for j in queued:
                try:
                    jobs.append(QueuedJob(j.id, self.store.job_spec(j), j.seq))
                except ValueError as exc:  # pydantic's ValidationError is a ValueError
                    # A stored spec this version no longer accepts: fail that job, place
                    # the others (it used to stop all placement).
                    await self.db(
                        self.store.set_job_state,
                        j.id,
                        JobState.FAILED,
                        f"the stored spec no longer validates ({_first_line(exc)}); "
                        "fix it and submit the job again",
                    )
            bundles = {j.id: j.bundle_sha256 for j in queued}
            pending: dict[str, str | None] = {}
            for decision in schedule(jobs, PoolIndex(views), SUPPORTED_PATHS):
                outcome = decision.outcome
                if not isinstance(outcome, Placement):
                    pending[decision.job_id] = outcome.reason
                    continue
                try:
                    epoch = await self.db(
                        self.store.reserve_placement,
                        decision.job_id,
                        outcome.worker_ids,
                        outcome.path.value,
                    )
                except PlacementConflict as exc:
                    log.info("placement lost a race: %s", exc)
                    continue
                self.metrics.placement.observe(time.perf_counter() - started)
                spec = next(j.spec for j in jobs if j.id == decision.job_id)
                run = GangRun(
                    job_id=decision.job_id,
                    epoch=epoch.number,
                    spec=spec,
                    path=outcome.path,
                    workers=list(outcome.worker_ids),
                    inventories=list(outcome.members),
                    bundle=bundles[decision.job_id],
                )
                self.runs[run.job_id] = run
                self.logs.note_senders(run.job_id, run.workers)
                await self._start_rendezvous(run)
            if pending:
                # One transaction, and only the reasons that changed are written.
                await self.db(self.store.set_why_pending_many, pending)

    async def _start_rendezvous(self, run: GangRun) -> None:
        await self.db(
            self.store.set_job_state,
            run.job_id,
            JobState.RENDEZVOUS,
            f"epoch {run.epoch}: waiting for node0 to publish its address",
        )
        if run.spec.timeout:
            run.deadline = time.monotonic() + run.spec.timeout
        planned = gang_addressing(run.path, run.inventories, 0)
        node0 = self.links.get(run.workers[0])
        sent = node0 is not None and await node0.send(
            Kind.PREPARE_RENDEZVOUS,
            {
                "job": run.job_id,
                "epoch": run.epoch,
                "addr": planned.master_addr,
                "port": run.spec.gang.rendezvous.port,
            },
        )
        if not sent:
            await self._fail(run, f"node0 (worker {run.workers[0]}) was lost before rendezvous")

    # ---- frames from agents --------------------------------------------------------------

    async def on_frame(self, link: Link, frame: Frame) -> None:
        body = frame.body
        kind = frame.kind
        if kind is Kind.HEARTBEAT:
            await link.send(Kind.HEARTBEAT_ACK, {"stop": self._stops_for(link.worker_id)})
        elif kind is Kind.LOGS:
            await self.logs.put(link, body)
        elif kind is Kind.INVENTORY:
            await self._inventory(link, body)
        else:
            async with self.lock:
                run = self.runs.get(str(body.get("job")))
                if run is None or body.get("epoch") != run.epoch:
                    if kind in (Kind.RENDEZVOUS_READY, Kind.MEMBER_STARTED):
                        await link.send(Kind.STOP, {"job": body.get("job"), "reason": "stale"})
                    elif kind is Kind.MEMBER_EXITED:
                        # The member of a job no longer tracked is gone: its worker is free.
                        await self.db(
                            self.store.release_worker, link.worker_id, str(body.get("job"))
                        )
                        self.request_pass()
                    return
                node = run.node_of(link.worker_id)
                if node is None or node != body.get("node_rank", node):
                    return
                if kind is Kind.RENDEZVOUS_READY and node == 0:
                    await self._published(run, str(body["addr"]), int(body["port"]))
                elif kind is Kind.MEMBER_STARTED:
                    await self._member_started(run, node)
                elif kind is Kind.MEMBER_EXITED:
                    await self._member_exited(run, node, body)
                elif kind is Kind.ARTIFACTS_DONE:
                    await self._outputs_stored(run, node, body)

    def _stops_for(self, worker_id: str) -> list[str]:
        return [
            run.job_id
            for run in self.runs.values()
            if run.over
            and (node := run.node_of(worker_id)) is not None
            and node in run.started
            and node not in run.exited
        ]

    async def _inventory(self, link: Link, body: dict[str, Any]) -> None:
        inventory = WorkerInventory.model_validate(body["inventory"], strict=False)
        if inventory.id != link.worker_id:
            await link.send(Kind.ERROR, {"message": "inventory id differs from the link's"})
            return
        running = [str(j) for j in body.get("running", [])]
        # A worker still running a member (of a job that is over: it is told to stop) is
        # not idle until its agent reports that member gone, in a later INVENTORY.
        stale = [j for j in running if (r := self.runs.get(j)) is None or r.over]
        await self.db(self.store.upsert_worker, inventory, draining=bool(stale))
        for job_id in stale:
            await link.send(Kind.STOP, {"job": job_id, "reason": "the job is not running"})
        self.request_pass()

    async def _published(self, run: GangRun, addr: str, port: int) -> None:
        await self.db(self.store.set_epoch_rendezvous, run.job_id, run.epoch, addr, port)
        await self.db(
            self.store.record_event,
            "RendezvousPublished",
            f"node0 published {addr}:{port}",
            job=run.job_id,
            data={"addr": addr, "port": port},
        )
        run.addressing = gang_addressing(run.path, run.inventories, port)
        for node, worker_id in enumerate(run.workers):
            link = self.links.get(worker_id)
            assignment = {
                "job": run.job_id,
                "epoch": run.epoch,
                "node_rank": node,
                "spec": run.spec.model_dump(mode="json"),
                "path": run.path.value,
                "addresses": list(run.addressing.addresses),
                "interfaces": list(run.addressing.interfaces),
                "master_port": port,
                "bundle": run.bundle,
            }
            if link is None or not await link.send(Kind.ASSIGN, assignment):
                await self._fail(run, f"node{node} (worker {worker_id}) was lost before start")
                return
            await self.db(
                self.store.set_member_state,
                run.job_id,
                node,
                MemberState.ASSIGNED,
                path_address=run.addressing.addresses[node],
            )
            await self.db(
                self.store.record_event,
                "Assigned",
                f"node{node} (worker {worker_id}) assigned",
                job=run.job_id,
                data={"node": node, "worker": worker_id},
            )

    async def _member_started(self, run: GangRun, node: int) -> None:
        run.started.add(node)
        if run.over:
            return
        await self.db(self.store.set_member_state, run.job_id, node, MemberState.STARTING)
        await self.db(self.store.set_member_state, run.job_id, node, MemberState.RUNNING)
        if len(run.started) == len(run.workers):
            await self.db(
                self.store.set_job_state,
                run.job_id,
                JobState.RUNNING,
                f"all {len(run.workers)} nodes started",
            )

    async def _member_exited(self, run: GangRun, node: int, body: dict[str, Any]) -> None:
        code = int(body.get("exit_code", 1))
        run.exited[node] = code
        signal = body.get("signal")
        state = MemberState.SUCCEEDED if code == 0 else MemberState.FAILED
        if run.over and code != 0:
            state = MemberState.CANCELLED if signal else MemberState.FAILED
        await self.db(
            self.store.set_member_state, run.job_id, node, state, exit_code=code, signal=signal
        )
        if code != 0 and not run.over:
            await self._fail(run, _root_cause(run, node, body))
        elif run.over:
            self._forget_if_done(run)
        await self._maybe_succeed(run)
        self.request_pass()

    async def _outputs_stored(self, run: GangRun, node: int, body: dict[str, Any]) -> None:
        """The member's outputs went up; an upload that failed fails the job."""
        errors = [str(e) for e in body.get("errors") or []]
        if errors and not run.over:
            shown = "\n".join(f"  {e}" for e in errors[:20])
            more = f"\n  ... and {len(errors) - 20} more" if len(errors) > 20 else ""
            await self._fail(
                run,
                f"node{node} (worker {run.workers[node]}) could not upload "
                f"{len(errors)} output file(s); they stay in the agent's work dir:\n"
                f"{shown}{more}",
            )
            return
        run.uploaded.add(node)
        await self._maybe_succeed(run)

    async def _maybe_succeed(self, run: GangRun) -> None:
        everyone = set(range(len(run.workers)))
        if run.over:
            self._forget_if_done(run)
            return
        if (
            set(run.exited) == everyone
            and all(c == 0 for c in run.exited.values())
            and run.uploaded >= everyone
        ):
            run.over = True
            await self.db(
                self.store.set_job_state,
                run.job_id,
                JobState.SUCCEEDED,
                f"all {len(run.workers)} nodes exited 0",
            )
            self._forget_if_done(run)
            self.request_pass()

    def _forget_if_done(self, run: GangRun) -> None:
        if all(n in run.exited or n not in run.started for n in range(len(run.workers))):
            self.runs.pop(run.job_id, None)

    # ---- failure, cancel, loss -----------------------------------------------------------

    async def _fail(self, run: GangRun, cause: str, state: JobState = JobState.FAILED) -> None:
        """Fail (or cancel) the job: stop running members now, cancel the rest."""
        if run.over:
            return
        run.over = True
        await self.db(self.store.set_job_state, run.job_id, state, cause)
        for node, worker_id in enumerate(run.workers):
            # Running members stop now; assigned ones must never start.
            link = self.links.get(worker_id)
            if node not in run.exited and link is not None:
                await link.send(Kind.STOP, _stop_order(run, node, cause))
        self._forget_if_done(run)
        self.request_pass()

    async def cancel(self, job_id: str) -> None:
        async with self.lock:
            job = await self.db(self.store.job, job_id)
            state = JobState(job.state)
            if state.is_terminal:
                raise BadRequest(f"job {job_id} already {state.value}; nothing to cancel")
            run = self.runs.get(job_id)
            if run is not None:
                await self._fail(run, "cancelled by the user", JobState.CANCELLED)
            else:
                await self.db(
                    self.store.set_job_state, job_id, JobState.CANCELLED, "cancelled by the user"
                )

    async def link_up(self, link: Link) -> bool:
        """Register an authenticated link; False when that worker id is already connected."""
        if link.worker_id in self.links:
            return False
        self.links[link.worker_id] = link
        self.metrics.agents.set(len(self.links))
        return True

    async def link_down(self, link: Link, why: str, *, controller_exiting: bool = False) -> None:
        """The link's EOF (or silence) is the host's exit: its members are lost.

        When the controller itself is stopping, the jobs are left as they are: the next
        start fails them with that reason (see create_app).
        """
        if self.links.get(link.worker_id) is not link:
            return
        del self.links[link.worker_id]
        self.tickets.revoke(link.ticket)
        self.metrics.agents.set(len(self.links))
        async with self.lock:
            await self.db(self.store.set_worker_state, link.worker_id, WorkerState.OFFLINE)
            await self.db(self.store.record_event, "WorkerLost", why, worker=link.worker_id)
            if controller_exiting:
                return
            for run in list(self.runs.values()):
                node = run.node_of(link.worker_id)
                if node is None:
                    continue
                if node in run.exited:
                    if run.over or node in run.uploaded or run.exited[node] != 0:
                        continue
                    # It exited 0, but its outputs never arrived: the job cannot succeed.
                    await self._fail(
                        run,
                        f"node{node} (worker {link.worker_id}) was lost before its outputs "
                        f"were stored: {why}",
                    )
                    continue
                run.exited[node] = -1
                await self.db(self.store.set_member_state, run.job_id, node, MemberState.LOST)
                await self._fail(run, f"node{node} (worker {link.worker_id}) was lost: {why}")
                self._forget_if_done(run)
        self.request_pass()


def _stop_order(run: GangRun, node: int, reason: str) -> dict[str, Any]:
    return {"job": run.job_id, "epoch": run.epoch, "node_rank": node, "reason": reason}


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _root_cause(run: GangRun, node: int, body: dict[str, Any]) -> str:
    worker = run.workers[node]
    rank = body.get("failed_rank")
    code = body.get("failed_exit", body.get("exit_code"))
    signal = body.get("signal")
    who = f"global rank {rank}" if rank is not None else "torchrun"
    how = f"was killed by {signal}" if signal else f"exited with code {code}"
    cause = f"node{node} (worker {worker}): {who} {how}"
    tail = [str(line) for line in body.get("tail", [])][-20:]
    if tail:
        label = f"rank {rank}" if rank is not None else f"node{node}"
        cause += f"\nlast lines of {label}:\n" + "\n".join(f"  {line}" for line in tail)
    return cause
