"""Join windows of ``membership: window`` jobs (seed 003), applied: muster.membership decides,
this module feeds it the walk-ins the controller sees and says what it decided.

A window job waits in the queue (state ``queued``; why-pending shows the window) while agents
started with ``muster join`` (their inventory names the job) walk in. The scheduler never
offers a walk-in to another job. When the window forms, the roster becomes the gang: node
rank r is the r-th admitted walk-in, and the job runs as any placed gang from there on. A
walk-in refused at the door, or whose job has ended, hears it in a JOIN_REPLY and leaves.

A window's roster lives in the controller's memory, its clock in the store (the job's
WindowOpened event): after a controller restart the window opens again with the clock it had
(the join timeout and hard cap still run from the first opening), and walk-ins that dial
again (``--persist``) are admitted again, in the order they come back.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from muster.controller.links import CLOSE_REFUSED
from muster.errors import BadRequest, NotFound, PlacementConflict
from muster.membership.cohort import (
    AFTER_FORMING,
    WindowEntry,
    door,
    hello_of,
    open_entry,
    status,
    summary,
    world_spec,
)
from muster.membership.window import (
    Admitted,
    Event,
    Failed,
    Formed,
    Join,
    Leave,
    Outcome,
    Refused,
    Renumbered,
    Start,
    Tick,
    open_window,
    step,
)
from muster.scheduler import Placement, Unplaceable, place_gang
from muster.spec import JobSpec, JobState, WorkerInventory, WorkerState, WorkerView
from muster.store.writes import EventWrite, JobStateWrite
from muster.wire import Kind

if TYPE_CHECKING:
    from muster.controller.gangs import Controller

log = logging.getLogger(__name__)

FORMED_KEPT = 256  # formed windows whose roster `muster status` still shows
# After a controller restart, the boxes of a window dial back within their back-off (at most
# 60 s, +20% jitter): its timeout forms no world before then.
REOPEN_GRACE_S = 75.0


def now() -> float:
    return time.time()


class WindowDesk:
    """The controller's join windows: fed by each scheduler pass (the lock held), the
    operator's start, and the links' ends."""

    def __init__(self, controller: Controller) -> None:
        self.c = controller
        self.entries: dict[str, WindowEntry] = {}
        self.told: set[str] = set()  # walk-ins told their job is not (or no longer) open
        self.wanted = False  # a walk-in reported in: run a pass even with an empty queue
        self.formed: dict[str, WindowEntry] = {}  # the last FORMED_KEPT that formed (status)
        # Jobs whose window failed or was cancelled, until the queue no longer holds them
        # (their FAILED is committed after the pass): never opened again meanwhile.
        self.closed: set[str] = set()
        # Walk-ins without a job (muster join, no --job) and the job whose world they formed:
        # told its verdict once it ends, then offered to the next window.
        self.served: dict[str, str] = {}

    def forget_link(self, worker: str) -> None:
        """A link went down: a walk-in that dials again is heard again."""
        self.told.discard(worker)
        for entry in self.entries.values():
            entry.told.discard(worker)

    async def left(self, worker: str) -> None:
        """A walk-in's link closed (the lock held): it leaves every open window at once, so
        a start fired now never forms a world with it."""
        for entry in list(self.entries.values()):
            if any(m.worker == worker for m in entry.window.roster):
                await self._step(entry, Leave(worker), now())

    async def cancelled(self, job: str) -> None:
        """The job was cancelled while its window was open (the lock held)."""
        entry = self.entries.pop(job, None)
        self.closed.add(job)
        if entry is not None and entry.window.phase.open:
            await self._tell_roster(entry, "the job was cancelled before its world formed")
        self._close_open_links(job, set())

    def due(self, at: float) -> bool:
        """Whether some open window's clock has run out (a pass then moves it)."""
        return any(
            (t := e.window.next_tick(at)) is not None and t <= at for e in self.entries.values()
        )

    async def run_pass(
        self,
        windowed: dict[str, JobSpec],
        bundles: dict[str, str | None],
        walk_ins: list[WorkerView],
    ) -> dict[str, str | None]:
        """One pass over the queued window jobs: open new windows, admit or refuse the
        walk-ins, apply the clock, form or fail. Returns each window job's why-pending."""
        at = now()
        self.wanted = False
        reasons: dict[str, str | None] = {}
        for gone in list(self.entries.keys() - windowed.keys()):
            ended = self.entries.pop(gone)  # cancelled while its window was open
            if ended.window.phase.open:
                await self._tell_roster(ended, "the job was cancelled before its world formed")
        self.closed &= windowed.keys()
        idle = [v.inventory for v in walk_ins if v.state is WorkerState.IDLE]
        anyone = [i for i in idle if i.join and i.join.job is None and await self._free(i)]
        for job, spec in windowed.items():
            if job in self.closed:
                continue
            entry = self.entries.get(job)
            if entry is None:
                entry = self.entries[job] = await self._open(job, spec, bundles.get(job), at)
            on_rosters = {m.worker for e in self.entries.values() for m in e.window.roster}
            mine = [i for i in idle if i.join and i.join.job == job]
            # A walk-in for any job goes to the oldest open window that takes it.
            # (a window open to boxes without the secret never gets a fleet box that holds it)
            window_of = spec.gang.window
            if not (window_of and (window_of.named_only or window_of.open_admission)):
                # (served: formed into another window earlier in this very pass)
                mine += [i for i in anyone if i.id not in on_rosters and i.id not in self.served]
            await self._admit(entry, mine, at)
            if job in self.entries and entry.window.phase.open:
                reasons[job] = summary(job, entry.window, at)
        for inventory in idle:
            assert inventory.join is not None
            wanted = inventory.join.job
            if wanted is not None and wanted not in windowed and inventory.id not in self.told:
                await self._not_open(inventory)
        return reasons

    async def _open(self, job: str, spec: JobSpec, bundle: str | None, at: float) -> WindowEntry:
        """The job's window: its clock runs from when it first opened, as recorded, so a
        controller restart neither restarts the join timeout nor lifts the hard cap."""
        opened = await self.c.db(self.c.store.window_opened_at, job)
        if opened is not None and opened <= at:
            entry = open_entry(job, spec, bundle, opened)
            rules = entry.window.rules
            # The roster forms anew as the boxes dial back (their back-off may have grown to
            # a minute): the timeout does not form the world before they had the time to;
            # the hard cap stands.
            late = min(
                rules.max_join_timeout, max(rules.join_timeout, at - opened + REOPEN_GRACE_S)
            )
            if late != rules.join_timeout:
                entry.window = open_window(replace(rules, join_timeout=late), opened)
            log.info(
                "job %s: its join window opened %.0fs ago; its roster forms anew", job, at - opened
            )
            return entry
        entry = open_entry(job, spec, bundle, at)
        rules = entry.window.rules
        said = f"join window open: start {rules.start}, quorum {rules.quorum}"
        if rules.target is not None:
            said += f", target {rules.target}"
        said += f", timeout {rules.join_timeout:.0f}s, hard cap {rules.max_join_timeout:.0f}s"
        if spec.gang.window is not None and spec.gang.window.open_admission:
            said += "; OPEN ADMISSION: boxes walk in without the join secret"
            log.warning(
                "job %s: its join window admits any box that reaches this controller, without "
                "the join secret (open_admission): such a box runs the job's code and joins "
                "its world. Use it only on a network you trust entirely",
                job,
            )
        self.c.writer.submit([EventWrite("WindowOpened", said, job, data={"opened_at": at})])
        return entry

    async def _free(self, inventory: WorkerInventory) -> bool:
        """Whether a walk-in for any job is free for a window: it serves no run whose end it
        has not heard yet (it is told that end here, once)."""
        served = self.served.get(inventory.id)
        if served is None:
            return True
        try:
            state = JobState((await self.c.db(self.c.store.job, served)).state)
        except NotFound:
            state = JobState.CANCELLED
        if not state.is_terminal:
            return False  # its part ended, the run goes on: it hears the verdict later
        del self.served[inventory.id]
        await self._send(
            inventory.id,
            served,
            False,
            f"job {served} {state.value}",
            ended=True,
            state=state.value,
        )
        return False  # it decides (persist: dial again) before it is offered again

    async def start(self, job: str) -> dict[str, Any]:
        """``muster start``: fire a staging window (the lock held); BadRequest says why not."""
        entry = self.entries.get(job)
        if entry is None:
            state = (await self.c.db(self.c.store.job, job)).state
            raise BadRequest(
                f"job {job} has no open join window (it is {state}); `muster start` fires the "
                "window of a membership: window job that is still waiting"
            )
        for member in entry.window.roster:  # a box whose link is gone is not in the world
            if member.worker not in self.c.links:
                await self._step(entry, Leave(member.worker), now())
        window, out = step(entry.window, Start(), now())
        entry.window = window
        refused = [o for o in out if isinstance(o, Refused) and o.worker is None]
        # The clock may have formed or failed the window just before the start: that stands,
        # and the answer says what became of it.
        await self._apply(entry, [o for o in out if o not in refused])
        if refused and not any(isinstance(o, (Formed, Failed)) for o in out):
            raise BadRequest(f"not started: {refused[0].reason}")
        return status(entry, "queued" if window.phase.open else "placing", now())

    async def view(self, job: str) -> dict[str, Any]:
        """The window of ``job`` as ``muster status`` shows it; once it formed, the phase
        follows the job (forming until its ranks run, then training, done or failed)."""
        record = await self.c.db(self.c.store.job, job)
        entry = self.entries.get(job)
        if entry is not None:
            return status(entry, record.state, now())
        view = status(self.formed.get(job), record.state, now())
        if (record.spec.get("distributed") or {}).get("membership") == "window":
            view["phase"] = AFTER_FORMING.get(record.state, "forming")
            view["startable"] = False
        return view

    # ---- inside a pass ------------------------------------------------------------------

    async def _admit(self, entry: WindowEntry, walk_ins: list[WorkerInventory], at: float) -> None:
        links = self.c.links
        for member in entry.window.roster:  # a walk-in whose link is gone has left
            if member.worker not in links:
                await self._step(entry, Leave(member.worker), at)
        on_roster = {m.worker for m in entry.window.roster}
        for inventory in walk_ins:
            if inventory.id in on_roster or inventory.id in entry.told:
                continue
            if not entry.window.phase.open:
                break
            why = door(entry, inventory) or self._fits(entry, inventory)
            if why:
                entry.told.add(inventory.id)
                # A walk-in for any job is not sent away by one window: it waits for another.
                waiting = inventory.join is not None and inventory.join.job is None
                await self._reply(inventory.id, entry, admitted=False, reason=why, waiting=waiting)
                continue
            assert inventory.join is not None
            entry.inventories[inventory.id] = inventory
            entry.hellos[inventory.id] = hello_of(inventory, entry.job, entry.bundle)
            await self._step(
                entry, Join(inventory.id, inventory.join.host, inventory.join.ranks), at
            )
        await self._step(entry, Tick(), at)

    def _fits(self, entry: WindowEntry, inventory: WorkerInventory) -> str:
        """Why the roster with this box could not form one gang (a path all share, each box
        fit for the job), or "" when it could: refused now rather than fail at forming."""
        boxes = [*(entry.inventories[m.worker] for m in entry.window.roster), inventory]
        assert inventory.join is not None
        ranks = [*(m.ranks for m in entry.window.roster), inventory.join.ranks]
        trial = world_spec(entry.spec, entry.window, ranks)
        outcome = place_gang(
            trial,
            [WorkerView(inventory=i) for i in boxes],
            paths=self.c.supported_paths,
            apart=self.c.apart_of(entry.job),
        )
        if isinstance(outcome, Unplaceable):
            host = inventory.join.host
            return f"with {host} the boxes in could not form one gang: {outcome.reason}"
        return ""

    async def _step(self, entry: WindowEntry, event: Event, at: float) -> None:
        window, out = step(entry.window, event, at)
        entry.window = window
        await self._apply(entry, out)

    async def _apply(self, entry: WindowEntry, out: list[Outcome]) -> None:
        for outcome in out:
            if isinstance(outcome, Admitted):
                member = next(m for m in entry.window.roster if m.worker == outcome.worker)
                log.info(
                    "job %s: %s walked in (ranks %d-%d)",
                    entry.job,
                    member.host,
                    outcome.first_rank,
                    outcome.first_rank + outcome.ranks - 1,
                )
                await self._reply(outcome.worker, entry, admitted=True)
            elif isinstance(outcome, Refused) and outcome.worker is not None:
                entry.told.add(outcome.worker)
                entry.inventories.pop(outcome.worker, None)
                entry.hellos.pop(outcome.worker, None)
                await self._reply(outcome.worker, entry, admitted=False, reason=outcome.reason)
            elif isinstance(outcome, Renumbered):
                for member in outcome.members:
                    await self._reply(member.worker, entry, admitted=True)
            elif isinstance(outcome, Formed):
                await self._form(entry, outcome)
            elif isinstance(outcome, Failed):
                self.entries.pop(entry.job, None)
                self.closed.add(entry.job)
                self.c.writer.submit([JobStateWrite(entry.job, JobState.FAILED, outcome.reason)])
                await self._tell_roster(entry, outcome.reason)
        for worker in set(entry.inventories) - {m.worker for m in entry.window.roster}:
            if entry.window.phase.open:  # left before forming
                entry.inventories.pop(worker, None)
                entry.hellos.pop(worker, None)

    async def _form(self, entry: WindowEntry, formed: Formed) -> None:
        """The roster becomes the gang: node rank r is the r-th walk-in admitted."""
        job, spec = entry.job, entry.spec
        self.entries.pop(job, None)
        self.formed[job] = entry
        while len(self.formed) > FORMED_KEPT:
            del self.formed[next(iter(self.formed))]
        hosts = len(formed.roster)
        world = world_spec(spec, entry.window, [m.ranks for m in formed.roster])
        members = [entry.inventories[m.worker] for m in formed.roster]
        outcome = place_gang(
            world,
            [WorkerView(inventory=i) for i in members],
            paths=self.c.supported_paths,
            apart=self.c.apart_of(job),
        )
        if isinstance(outcome, Unplaceable):
            why = f"the walk-ins cannot form one gang: {outcome.reason}"
            self.closed.add(job)
            self.c.writer.submit([JobStateWrite(job, JobState.FAILED, why)])
            await self._tell_roster(entry, why)
            return
        order = {m.worker: r for r, m in enumerate(formed.roster)}
        placement = Placement(
            outcome.path, tuple(sorted(outcome.members, key=lambda i: order[i.id]))
        )
        await self.c.writer.barrier()
        try:
            await self.c.db(self.c.store.set_job_spec, job, world.model_dump(mode="json"))
        except BadRequest as exc:  # no longer queued (cancelled meanwhile)
            await self._tell_roster(entry, f"the world did not form: {exc}")
            return
        reserved = await self.c.db(
            self.c.store.reserve_placements, [(job, placement.worker_ids, placement.path.value)]
        )
        epoch = reserved[job]
        if isinstance(epoch, PlacementConflict):
            why = f"the walk-ins were taken before the gang formed: {epoch}"
            self.closed.add(job)
            self.c.writer.submit([JobStateWrite(job, JobState.FAILED, why)])
            await self._tell_roster(entry, why)
            return
        for member in members:
            assert member.join is not None
            if member.join.job is None:
                self.served[member.id] = job
        log.info(
            "job %s: the world formed on %s with %d host(s), %d rank(s)",
            job,
            entry.window.started_by,
            hosts,
            formed.world_size,
        )
        self._close_open_links(job, {m.worker for m in formed.roster})
        await self.c.start_placed(job, world, placement, epoch.number, entry.bundle)

    async def _not_open(self, inventory: WorkerInventory) -> None:
        """A walk-in for a job with no open window: say what became of the job."""
        assert inventory.join is not None
        job = inventory.join.job
        assert job is not None
        try:
            record = await self.c.db(self.c.store.job, job)
        except NotFound:
            self.told.add(inventory.id)
            await self._send(inventory.id, job, False, f"there is no job {job}; check --job")
            return
        state = JobState(record.state)
        run = self.c.runs.get(job)
        if (record.spec.get("distributed") or {}).get("membership") != "window":
            why = f"job {job} is placed by the scheduler (membership: pool), not a join window"
            self.told.add(inventory.id)
            await self._send(inventory.id, job, False, why)
        elif not state.is_terminal and state is not JobState.QUEUED:
            if run is not None and run.gang.node_of(inventory.id) is not None:
                return  # its part ended; it hears the job's verdict when the job ends
            self.told.add(inventory.id)
            why = (
                f"the window of job {job} is closed: its world formed without "
                f"{inventory.join.host} (dial again for a later run)"
            )
            await self._send(inventory.id, job, False, why)
        elif state.is_terminal:
            self.told.add(inventory.id)
            why = f"job {job} {state.value}"
            await self._send(inventory.id, job, False, why, ended=True, state=state.value)

    def _close_open_links(self, job: str, keep: set[str]) -> None:
        """The window of ``job`` closed: links admitted without the secret for it that are
        not in its world have nothing left to do here (one that never walked in, or that
        reports a member of its own invention, would otherwise stay for ever)."""
        for link in list(self.c.links.values()):
            if link.open_job == job and link.worker_id not in keep:
                self.c.close_later(link, CLOSE_REFUSED)

    async def _tell_roster(self, entry: WindowEntry, why: str) -> None:
        for member in entry.window.roster:
            box = entry.inventories.get(member.worker)
            if box is not None and box.join is not None and box.join.job is None:
                # It walked in for any job: it waits for the next window.
                await self._send(member.worker, entry.job, False, why, waiting=True)
                continue
            self.told.add(member.worker)
            await self._send(member.worker, entry.job, False, why)
        self._close_open_links(entry.job, set())

    async def _reply(
        self,
        worker: str,
        entry: WindowEntry,
        *,
        admitted: bool,
        reason: str = "",
        waiting: bool = False,
    ) -> None:
        member = next((m for m in entry.window.roster if m.worker == worker), None)
        body: dict[str, Any] = {"phase": entry.window.phase.value}
        if waiting:
            body["waiting"] = True
        if member is not None:
            body |= {"first_rank": member.first_rank, "ranks": member.ranks}
        await self._send(worker, entry.job, admitted, reason, **body)

    async def _send(self, worker: str, job: str, admitted: bool, reason: str, **more: Any) -> None:
        link = self.c.links.get(worker)
        if link is not None:
            await link.send(
                Kind.JOIN_REPLY, {"job": job, "admitted": admitted, "reason": reason, **more}
            )
            if link.open_job and not admitted and not more.get("waiting"):
                # Admitted without the join secret for this window, which has nothing more
                # for it: the link ends (an honest box leaves on this reply anyway).
                self.c.close_later(link, CLOSE_REFUSED)
