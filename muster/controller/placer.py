"""The scheduler pass: which queued jobs to place now, their reservations, their runs' start.

One pass runs under the controller's lock: it reads the queue and the workers, asks
``muster.scheduler.schedule`` (no I/O) which jobs fit, reserves every placed gang in one
transaction, and starts each run (its ``Placed`` event, through the controller's step).
The jobs left waiting get their why-pending reason, written when its kind changes and at
most every WHY_PENDING_REFRESH_S otherwise, and an Unplaceable event for each kind once.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from muster.controller.runs import RunEntry
from muster.errors import BadRequest, PlacementConflict, SpecError
from muster.gang import GangRun, Placed
from muster.plan import MESH_MAX_NODES, gang_addressing
from muster.scheduler import IP_COLLISION, Placement, PoolIndex, QueuedJob, schedule
from muster.spec import (
    JobSpec,
    JobState,
    PathClass,
    WorkerInventory,
    WorkerView,
    first_problems,
    load_stored_job,
)
from muster.store.hot import reason_gist
from muster.store.writes import (
    ConditionWrite,
    EventWrite,
    JobStateWrite,
    ReleaseWrite,
    WhyPendingWrite,
)

if TYPE_CHECKING:
    from muster.controller.gangs import Controller

log = logging.getLogger("muster.controller")

# A why-pending reason whose kind (first clause) is unchanged is rewritten at most this
# often: its counts move on nearly every pass, and writing ~1,000 of them each pass cost
# more than the placement.
WHY_PENDING_REFRESH_S = 2.0


def told_before(said: dict[str, set[str]], due: Mapping[str, str | None]) -> frozenset[str]:
    """The jobs of ``due`` whose reason is of a kind (its first clause) their Unplaceable
    events said already; ``said`` (job -> kinds) learns the others'."""
    quiet = set()
    for job_id, reason in due.items():
        if reason is None:
            continue
        kinds = said.setdefault(job_id, set())
        kind = reason_gist(reason) or ""
        if kind in kinds:
            quiet.add(job_id)
        kinds.add(kind)
    return frozenset(quiet)


class Placer:
    """The controller's scheduler passes (``Controller.scheduler_pass`` runs one); it keeps
    what passes remember of the queued jobs."""

    def __init__(self, controller: Controller) -> None:
        self.c = controller
        self._specs: dict[str, JobSpec] = {}  # queued jobs' parsed specs
        self._why: dict[str, tuple[str | None, float]] = {}  # queued: (reason written, when)
        # queued: the kinds of reason (reason_gist) its Unplaceable events have said already;
        # a busy queue flips a job between two kinds, and the log says each once.
        self._said: dict[str, set[str]] = {}

    async def run_pass(self) -> None:
        async with self.c.lock:
            started = time.perf_counter()
            if self.c.exiting:
                return  # the links are closing: nothing placed now could be started
            queued, workers, stored = await self.c.db(self._pass_reads)
            if not queued and not self.c.windows.wanted and not self.c.windows.entries:
                return
            try:
                await self._place(queued, workers, stored, started)
            finally:
                self.c.metrics.scheduler_pass.observe(time.perf_counter() - started)

    def _pass_reads(
        self,
    ) -> tuple[list[tuple[str, int, str | None]], list[WorkerView], dict[str, dict[str, Any]]]:
        """What a pass reads, in one trip to a worker thread (under load each trip waits its
        turn on the event loop): the queue, every worker, and the specs not validated yet.
        (``_specs`` changes only in a pass, and the pass holds the lock.)"""
        queued = self.c.store.queued()  # (the workers always: a walk-in may want a pass)
        new = [job_id for job_id, _seq, _bundle in queued if job_id not in self._specs]
        return queued, self.c.store.workers(), self.c.store.specs(new) if new else {}

    async def _place(
        self,
        queued: list[tuple[str, int, str | None]],
        workers: list[WorkerView],
        stored: dict[str, dict[str, Any]],
        started: float,
    ) -> None:
        """One pass over a non-empty queue (the lock held)."""
        # Only workers with a live link: a lost one may still read idle until the group
        # commit of its OFFLINE lands.
        # Nor a worker whose INVENTORY is on its way to the store: that write decided what
        # the worker is free for before this pass, and would overwrite a reservation made now.
        linked = [
            v
            for v in workers
            if v.inventory.id in self.c.links and v.inventory.id not in self.c._recording
        ]
        # A walk-in (muster join) serves the window of its job only.
        views = [v for v in linked if v.inventory.join is None]
        walk_ins = [v for v in linked if v.inventory.join is not None]
        jobs = []
        windowed: dict[str, JobSpec] = {}
        for job_id, seq, _bundle in queued:
            spec = self._specs.get(job_id)
            if spec is None:  # validated once: a stored spec never changes
                try:
                    spec = self._specs[job_id] = load_stored_job(stored[job_id], job_id)
                except SpecError as exc:
                    # A stored spec this version no longer accepts: fail that job, place
                    # the others (it used to stop all placement).
                    await self.c.db(
                        self.c.store.set_job_state,
                        job_id,
                        JobState.FAILED,
                        f"the stored spec no longer validates ({first_problems(exc)}); "
                        "fix it and submit the job again",
                    )
                    self.c._forget_fences(job_id)
                    continue
            if spec.gang.membership == "window":
                windowed[job_id] = spec
                continue
            jobs.append(QueuedJob(job_id, spec, seq, self.c._apart.get(job_id)))
        still = {job_id for job_id, _s, _b in queued}
        for gone in self._specs.keys() - still:
            del self._specs[gone]  # cancelled while queued
        for gone in self._why.keys() - still:
            del self._why[gone]
            self._said.pop(gone, None)
        specs = {j.id: j.spec for j in jobs}
        bundles = {job_id: bundle for job_id, _seq, bundle in queued}
        pending: dict[str, str | None] = {}
        placements: dict[str, Placement] = {}
        pool = PoolIndex(views)
        for entry in self.c.runs.values():  # a private gang's addresses are its own
            if entry.gang.path is PathClass.PRIVATE and len(entry.inventories) > 1:
                pool.hold_private(inv.network.private_address for inv in entry.inventories)
            elif entry.gang.path is PathClass.RELAYED:  # and a relayed one's, its own
                pool.hold_relayed(inv.advertise_address for inv in entry.inventories)
        for decision in schedule(jobs, pool, self.c.supported_paths):
            outcome = decision.outcome
            if isinstance(outcome, Placement):
                placements[decision.job_id] = outcome
            else:
                pending[decision.job_id] = outcome.reason
        # Every gang of the pass reserved in one transaction (each all or nothing).
        reserved = (
            await self.c.db(
                self.c.store.reserve_placements,
                [(job_id, p.worker_ids, p.path.value) for job_id, p in placements.items()],
            )
            if placements
            else {}
        )
        for job_id, outcome in placements.items():
            epoch = reserved[job_id]
            if isinstance(epoch, PlacementConflict):
                log.info("placement lost a race: %s", epoch)
                continue
            self.c.metrics.placement.observe(time.perf_counter() - started)
            self._specs.pop(job_id, None)
            self._why.pop(job_id, None)
            self._said.pop(job_id, None)
            await self.start_placed(job_id, specs[job_id], outcome, epoch.number, bundles[job_id])
        pending.update(await self.c.windows.run_pass(windowed, bundles, walk_ins))
        due = self._why_due(pending)
        if due:
            # A gang kept off the private path by another gang's addresses says so in its
            # GangReady condition too, as Kubernetes writes one, when that starts.
            changed = [
                write
                for job_id, reason in due.items()
                if (write := self._collision_change(job_id, reason)) is not None
            ]
            # With the group commit, not awaited: only the reasons that changed are
            # written, and only on jobs still queued when it commits.
            quiet = told_before(self._said, due)
            self.c.writer.submit([*changed, WhyPendingWrite(due, quiet)])
            written = time.monotonic()
            self._why.update((job_id, (reason, written)) for job_id, reason in due.items())

    async def start_placed(
        self, job_id: str, spec: JobSpec, outcome: Placement, epoch: int, bundle: str | None
    ) -> None:
        """A reserved gang (``outcome.members[r]`` is node rank r) starts its run (the lock
        held): the lifecycle's Placed event, and from there on its actions."""
        entry = RunEntry(GangRun(), spec, list(outcome.members), bundle)
        self.c.runs[job_id] = entry
        self.c.logs.note_senders(job_id, list(outcome.worker_ids))
        try:
            if outcome.path is PathClass.DIRECT:
                if len(outcome.worker_ids) > MESH_MAX_NODES:
                    raise BadRequest(
                        f"the direct path takes at most {MESH_MAX_NODES} members; "
                        f"this gang has {len(outcome.worker_ids)}"
                    )
                entry.mesh = self.c._free_mesh()
            if outcome.path is PathClass.RELAYED and len(outcome.members) > 1:
                self.c.writer.submit([EventWrite("RelayedPath", _why_relayed(outcome), job_id)])
            planned = gang_addressing(outcome.path, entry.inventories, 0, entry.mesh)
            await self.c._step(
                entry,
                Placed(
                    job=job_id,
                    epoch=epoch,
                    workers=tuple(outcome.worker_ids),
                    path=outcome.path,
                    port=spec.gang.rendezvous.port,
                    timeout=spec.timeout or None,
                    master_addr=planned.master_addr,
                    probe_seconds=_probe_seconds(spec, entry.inventories),
                    fail_on_hang=spec.on_hang == "fail",
                    hang_timeout=spec.hang_timeout,
                    # An epoch fenced for its packets' size alone is not counted.
                    spare_epochs=1 if job_id in self.c._packets else 0,
                ),
            )
        except Exception as exc:  # one gang's trouble does not strand the others
            self.c.metrics.internal_errors.labels("supervise").inc()
            log.exception("job %s: starting its placed gang failed", job_id)
            if not entry.gang.members:  # never stepped: give its workers back
                del self.c.runs[job_id]
                self.c.writer.submit(
                    [
                        JobStateWrite(job_id, JobState.FAILED, f"starting the gang: {exc}"),
                        *(ReleaseWrite(w, job_id) for w in outcome.worker_ids),
                    ]
                )

    def _collision_change(self, job_id: str, reason: str | None) -> ConditionWrite | None:
        """GangReady when a waiting job's IPCollision starts (False, IPCollision) or ends
        while it still waits (False, Pending, with the new reason); else None."""
        if reason is None:
            return None  # placed: the run sets its own conditions
        last = self._why.get(job_id)
        had = last is not None and last[0] is not None and IP_COLLISION in last[0]
        has = IP_COLLISION in reason
        if has and not had:
            clause = reason[reason.index(IP_COLLISION) :]
            return ConditionWrite(job_id, "GangReady", False, IP_COLLISION, clause)
        if had and not has:
            return ConditionWrite(job_id, "GangReady", False, "Pending", reason[:500])
        return None

    def _why_due(self, pending: dict[str, str | None]) -> dict[str, str | None]:
        """The reasons to write now: new kinds at once, moved counts every few seconds."""
        now = time.monotonic()
        due: dict[str, str | None] = {}
        for job_id, reason in pending.items():
            last = self._why.get(job_id)
            if last is None or (
                last[0] != reason
                and (
                    reason_gist(last[0]) != reason_gist(reason)
                    or now - last[1] >= WHY_PENDING_REFRESH_S
                )
            ):
                due[job_id] = reason
        return due


def _why_relayed(outcome: Placement) -> str:
    """Why a gang goes through the relays: the members that cannot make a device, and that
    they share no private network (the scheduler takes relayed only when nothing else fits)."""
    cannot = [
        f"{m.id} ({'container-only' if m.network.container_only else 'no WireGuard device'})"
        for m in outcome.members
        if not m.network.can_create_device
    ]
    networks = {m.network.private_network_id for m in outcome.members}
    shared = len(networks) == 1 and None not in networks
    return (
        "relayed (4x the cost of direct to the scheduler): "
        + (", ".join(cannot) + " cannot join a direct path" if cannot else "no direct path")
        + ("" if shared else "; the members share no private network")
    )


def _probe_seconds(spec: JobSpec, members: Sequence[WorkerInventory]) -> float | None:
    """The spec's probe, for a gang that spans machines (on one host's loopback there is
    no path to prove). On the relayed path it measures through the relays, as the ranks'
    traffic will go."""
    if len(members) < 2 or spec.gang.probe_seconds is None:
        return None
    if all(ipaddress.ip_address(m.advertise_address or "127.0.0.1").is_loopback for m in members):
        return None
    return spec.gang.probe_seconds
