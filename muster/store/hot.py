"""The controller's hot writes in SQLAlchemy Core: no ORM objects, no flush, no evaluation.

A busy controller writes a handful of rows per member frame and reserves tens of gangs per
scheduler pass. Through the ORM each of those writes built objects, flushed a unit of work
and evaluated bulk updates against the session: half a core at a few dozen gangs a second.
Here every statement is built once at import (so SQLAlchemy's cache key is memoised) and runs
on the session's connection, inside the caller's transaction. The rules are the same as the
ORM paths in ``store.jobs``: every check happens before the first change, so a refused write
leaves nothing behind.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, NamedTuple, cast

from sqlalchemy import (
    Connection,
    Table,
    Text,
    bindparam,
    func,
    insert,
    select,
    update,
)
from sqlalchemy import cast as sql_cast

from muster.errors import BadRequest, NotFound, PlacementConflict
from muster.spec.states import (
    JobState,
    MemberState,
    WorkerState,
    check_job_transition,
    check_member_transition,
)
from muster.store.base import utcnow
from muster.store.models import Condition, Event, GangEpoch, Job, Member, Worker

JOBS = cast(Table, Job.__table__)
WORKERS = cast(Table, Worker.__table__)
EPOCHS = cast(Table, GangEpoch.__table__)
MEMBERS = cast(Table, Member.__table__)
EVENTS = cast(Table, Event.__table__)
CONDITIONS = cast(Table, Condition.__table__)

MEMBERS_PER_READ = 500  # job ids per IN (...) when reading the members a batch touches

_JOB_STATE = select(JOBS.c.state).where(JOBS.c.id == bindparam("job")).with_for_update()
_SET_JOB = update(JOBS).where(JOBS.c.id == bindparam("_job"))
_WORKERS_FOR = (
    select(WORKERS.c.id, WORKERS.c.state, WORKERS.c.advertise_address)
    .where(WORKERS.c.id.in_(bindparam("ids", expanding=True)))
    .order_by(WORKERS.c.id)
    .with_for_update()
)
_RESERVE = (
    update(WORKERS)
    .where(WORKERS.c.id.in_(bindparam("ids", expanding=True)))
    .values(state=WorkerState.RESERVED.value, job_id=bindparam("job"))
)
_LAST_EPOCH = select(func.max(EPOCHS.c.number)).where(EPOCHS.c.job_id == bindparam("job"))
_NEW_EPOCH = insert(EPOCHS)
_NEW_MEMBERS = insert(MEMBERS)
_NEW_EVENTS = insert(EVENTS)
_MEMBERS_OF = (
    select(
        MEMBERS.c.id,
        MEMBERS.c.job_id,
        MEMBERS.c.node_rank,
        MEMBERS.c.state,
        MEMBERS.c.worker_id,
        EPOCHS.c.number,
    )
    .join(EPOCHS, MEMBERS.c.epoch_id == EPOCHS.c.id)
    .where(MEMBERS.c.job_id.in_(bindparam("jobs", expanding=True)))
)
_SET_MEMBER = update(MEMBERS).where(MEMBERS.c.id == bindparam("_member"))
_BUSY = (
    update(WORKERS)
    .where(WORKERS.c.id == bindparam("worker"), WORKERS.c.job_id == bindparam("job"))
    .values(state=WorkerState.BUSY.value)
)
_SET_WORKER = update(WORKERS).where(WORKERS.c.id == bindparam("_worker"))
_NEW_WORKER = insert(WORKERS)
# The inventory as its stored text: a pass compares it with the last one it validated and
# parses only what changed (200 inventories parsed per pass were most of reading them).
_WORKER_VIEWS = select(WORKERS.c.id, WORKERS.c.state, sql_cast(WORKERS.c.inventory, Text)).order_by(
    WORKERS.c.id
)
# Only a queued job has a why_pending: a reason written after the job was placed (the pass
# that found it waiting can commit after the next pass reserved it) is no reason at all.
WHY_PENDING = select(JOBS.c.id, JOBS.c.why_pending).where(
    JOBS.c.id.in_(bindparam("jobs", expanding=True)), JOBS.c.state == JobState.QUEUED.value
)
WHY_PENDING_PER_READ = 500  # job ids per IN (...)
_SET_WHY_PENDING = (
    update(JOBS)
    .where(JOBS.c.id == bindparam("_job"), JOBS.c.state == JobState.QUEUED.value)
    .values(why_pending=bindparam("why"))
)
_RENDEZVOUS = (
    update(EPOCHS)
    .where(EPOCHS.c.job_id == bindparam("job"), EPOCHS.c.number == bindparam("epoch"))
    .values(master_addr=bindparam("addr"), master_port=bindparam("port"))
)


class Reserved(NamedTuple):
    """A gang epoch just opened by a reservation."""

    id: int
    job_id: str
    number: int
    path_class: str


def event_row(
    kind: str,
    message: str,
    *,
    job: str | None = None,
    worker: str | None = None,
    data: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "job_id": job,
        "worker_id": worker,
        "time": utcnow(),
        "kind": kind,
        "message": message,
        "data": data or {},
    }


def insert_events(conn: Connection, rows: list[dict[str, Any]]) -> None:
    if rows:
        conn.execute(_NEW_EVENTS, rows)


def reserve(
    conn: Connection,
    job_id: str,
    worker_ids: Sequence[str],
    path_class: str,
    events: list[dict[str, Any]],
) -> Reserved:
    """Take the gang's workers for ``job_id`` and open its next epoch; the "Placed" event
    goes to ``events``. Raises PlacementConflict, having changed nothing, when the job is
    no longer queued or a worker no longer idle."""
    if len(set(worker_ids)) != len(worker_ids):
        raise BadRequest(f"a gang needs distinct workers, got {list(worker_ids)}")
    state = conn.execute(_JOB_STATE, {"job": job_id}).scalar()
    if state is None:
        raise NotFound(f"job {job_id!r} does not exist; see `muster get jobs`")
    if state != JobState.QUEUED.value:
        raise PlacementConflict(f"job {job_id} is {state}, not queued")
    # Rows locked in one global order, so racing reservations queue on PostgreSQL instead
    # of deadlocking (SQLite already serializes writers).
    rows = conn.execute(_WORKERS_FOR, {"ids": list(worker_ids)}).all()
    idle = sum(1 for row in rows if row.state == WorkerState.IDLE.value)
    if idle != len(worker_ids):
        raise PlacementConflict(
            f"job {job_id}: only {idle} of {len(worker_ids)} workers were still idle; "
            "the scheduler will try again"
        )
    addresses = {row.id: row.advertise_address for row in rows}
    conn.execute(_RESERVE, {"ids": list(worker_ids), "job": job_id})
    number = (conn.execute(_LAST_EPOCH, {"job": job_id}).scalar() or 0) + 1
    now = utcnow()
    key = conn.execute(
        _NEW_EPOCH,
        {"job_id": job_id, "number": number, "path_class": path_class, "created_at": now},
    ).inserted_primary_key
    assert key is not None
    epoch_id = key[0]
    conn.execute(
        _NEW_MEMBERS,
        [
            {
                "epoch_id": epoch_id,
                "job_id": job_id,
                "node_rank": rank,
                "worker_id": wid,
                "state": MemberState.PENDING.value,
                "advertise_address": addresses.get(wid),
            }
            for rank, wid in enumerate(worker_ids)
        ],
    )
    conn.execute(
        _SET_JOB,
        {
            "_job": job_id,
            "state": JobState.PLACING.value,
            "path_class": path_class,
            "why_pending": None,
        },
    )
    events.append(
        event_row(
            "Placed",
            f"epoch {number}: {len(worker_ids)} workers on the {path_class} path: "
            + ", ".join(f"node{r}={w}" for r, w in enumerate(worker_ids)),
            job=job_id,
            data={"epoch": number, "workers": list(worker_ids), "path": path_class},
        )
    )
    return Reserved(int(epoch_id), job_id, number, path_class)


def job_state(
    conn: Connection,
    job_id: str,
    new: JobState,
    message: str,
    events: list[dict[str, Any]],
) -> None:
    """``store.jobs.job_state_in`` without the ORM; its event goes to ``events``."""
    state = conn.execute(_JOB_STATE, {"job": job_id}).scalar()
    if state is None:
        raise NotFound(f"job {job_id!r} does not exist; see `muster get jobs`")
    check_job_transition(JobState(state), new)
    now = utcnow()
    values: dict[str, Any] = {"_job": job_id, "state": new.value}
    if new is JobState.RUNNING:
        values["started_at"] = now
    if new.is_terminal:
        values["finished_at"] = now
    if new is JobState.FAILED and message:
        values["root_cause"] = message
    conn.execute(_SET_JOB, values)
    events.append(
        event_row(f"Job{new.value.capitalize()}", message or f"job is {new.value}", job=job_id)
    )


class MemberNow(NamedTuple):
    id: int
    state: MemberState
    worker_id: str


class MemberStates:
    """The latest epoch's members of the jobs a batch touches, read once, moved in memory,
    and written back in a few executemany at the end of the batch (nothing else in a batch
    reads the members table, so deferring those updates inside the transaction is safe)."""

    def __init__(
        self, conn: Connection, jobs: Iterable[str], workers: WorkerStates | None = None
    ) -> None:
        self.conn = conn
        self.workers = workers  # the batch's (RUNNING makes a worker busy), or write at once
        self.now: dict[tuple[str, int], MemberNow] = {}
        epochs: dict[tuple[str, int], int] = {}
        wanted = sorted(set(jobs))
        for start in range(0, len(wanted), MEMBERS_PER_READ):
            chunk = wanted[start : start + MEMBERS_PER_READ]
            for row in conn.execute(_MEMBERS_OF, {"jobs": chunk}):
                key = (row.job_id, row.node_rank)
                if epochs.get(key, -1) < row.number:
                    epochs[key] = row.number
                    self.now[key] = MemberNow(row.id, MemberState(row.state), row.worker_id)
        self.changes: dict[int, dict[str, Any]] = {}

    def move(
        self,
        job_id: str,
        node: int,
        state: MemberState,
        *,
        exit_code: int | None = None,
        signal: str | None = None,
        path_address: str | None = None,
        at: datetime | None = None,
    ) -> None:
        """``store.jobs.member_state_in``'s rules: a terminal member stays as it is; the
        move must be in the member table; RUNNING makes the worker busy (at once)."""
        member = self.now.get((job_id, node))
        if member is None:
            raise NotFound(f"job {job_id!r} has no member with node rank {node}")
        if member.state.is_terminal:
            return
        check_member_transition(member.state, state)
        now = at or utcnow()
        values = self.changes.setdefault(member.id, {"_member": member.id})
        values["state"] = state.value
        if exit_code is not None:
            values["exit_code"] = exit_code
        if signal is not None:
            values["signal"] = signal
        if path_address is not None:
            values["path_address"] = path_address
        if state is MemberState.ASSIGNED:
            values["assigned_at"] = now
        elif state is MemberState.RUNNING:
            values["started_at"] = now
            if self.workers is not None:
                self.workers.busy(member.worker_id, job_id)
            else:
                self.conn.execute(_BUSY, {"worker": member.worker_id, "job": job_id})
        if state.is_terminal:
            values["finished_at"] = now
        self.now[(job_id, node)] = member._replace(state=state)

    def write(self) -> None:
        """The moved members, one executemany per set of columns changed."""
        _write_grouped(self.conn, _SET_MEMBER, self.changes.values())
        self.changes.clear()


def _write_grouped(conn: Connection, statement: Any, changes: Iterable[dict[str, Any]]) -> None:
    """``statement`` once per set of columns the ``changes`` set (an executemany each: its
    rows must all bind the same parameters)."""
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for values in changes:
        groups.setdefault(tuple(sorted(values)), []).append(values)
    for rows in groups.values():
        conn.execute(statement, rows)


# Locked (PostgreSQL; SQLite's write lock already holds them), in id order as a reservation
# locks them: a reservation committed between this read and the batch's end would otherwise
# be written over with what the batch decided from the older row.
_WORKERS_NOW = (
    select(WORKERS.c.id, WORKERS.c.state, WORKERS.c.job_id)
    .where(WORKERS.c.id.in_(bindparam("ids", expanding=True)))
    .order_by(WORKERS.c.id)
    .with_for_update()
)
_HELD = (WorkerState.RESERVED.value, WorkerState.BUSY.value)


class WorkerStates:
    """The workers a batch touches, as MemberStates does members: their state and job read
    in one statement, moved in memory in the batch's order, and written back at its end in
    one executemany per set of columns (a busy controller wrote four statements a member:
    its busy, its release, and its inventory's read and update). Nothing else in a batch
    reads the workers table, and the rows read are locked until the commit (no other
    transaction changes them meanwhile)."""

    def __init__(self, conn: Connection, worker_ids: Iterable[str]) -> None:
        self.conn = conn
        self.now: dict[str, tuple[str, str | None]] = {}  # id -> (state, job), rows that exist
        self.read: set[str] = set()  # ids asked of the database (found or not)
        self.changes: dict[str, dict[str, Any]] = {}  # id -> columns to set
        self.new: dict[str, dict[str, Any]] = {}  # id -> the row to insert
        self.load(worker_ids)

    def load(self, worker_ids: Iterable[str]) -> None:
        """Read the rows of those not read yet (one statement per 500)."""
        wanted = sorted(set(worker_ids) - self.read)
        for start in range(0, len(wanted), MEMBERS_PER_READ):
            chunk = wanted[start : start + MEMBERS_PER_READ]
            for row in self.conn.execute(_WORKERS_NOW, {"ids": chunk}):
                self.now[row.id] = (row.state, row.job_id)
        self.read.update(wanted)

    def _row(self, worker_id: str) -> tuple[str, str | None] | None:
        if worker_id not in self.read:
            self.load([worker_id])
        return self.now.get(worker_id)

    def _set(self, worker_id: str, **values: Any) -> None:
        row = self.new.get(worker_id)
        if row is None:
            row = self.changes.setdefault(worker_id, {"_worker": worker_id})
        row.update(values)
        state, job = self.now[worker_id]
        self.now[worker_id] = (values.get("state", state), values.get("job_id", job))

    def busy(self, worker_id: str, job_id: str) -> None:
        """A member of ``job_id`` runs there (only if the worker is still that job's)."""
        row = self._row(worker_id)
        if row is not None and row[1] == job_id:
            self._set(worker_id, state=WorkerState.BUSY.value)

    def release(self, worker_id: str, job_id: str) -> None:
        """Back to idle, if it is still held for ``job_id`` (not offline, not another's)."""
        row = self._row(worker_id)
        if row is not None and row[1] == job_id and row[0] in _HELD:
            self._set(worker_id, state=WorkerState.IDLE.value, job_id=None)

    def set_state(self, worker_id: str, state: WorkerState) -> None:
        if self._row(worker_id) is None:
            return  # as an UPDATE of no row
        values: dict[str, Any] = {"state": state.value}
        if state in (WorkerState.IDLE, WorkerState.OFFLINE):
            values["job_id"] = None
        self._set(worker_id, **values)

    def upsert(
        self,
        inventory: dict[str, Any],
        held_by: str | None,
        draining: bool,
        events: list[dict[str, Any]],
        now: datetime | None = None,
    ) -> None:
        """Record an agent's inventory (``WorkerInventory`` as JSON) and what the worker is
        free for; see ``WorkerRepository.upsert_worker``."""
        now = now or utcnow()
        worker_id = inventory["id"]
        row = self._row(worker_id)
        if held_by is not None:
            if row is not None and row[1] == held_by and row[0] in _HELD:
                state, job = row[0], held_by
            else:
                state, job = WorkerState.BUSY.value, held_by
        elif draining:
            state, job = WorkerState.BUSY.value, None
        else:  # nothing of any job runs there, as the controller and the agent see it
            state, job = WorkerState.IDLE.value, None
        values = {
            "hostname": inventory["hostname"],
            "advertise_address": inventory.get("advertise_address"),
            "inventory": inventory,
            "last_seen": now,
            "state": state,
            "job_id": job,
        }
        if row is None:
            self.new[worker_id] = {"id": worker_id, "joined_at": now, **values}
            self.now[worker_id] = (state, job)
            events.append(
                event_row(
                    "WorkerJoined",
                    f"worker {worker_id} ({inventory['hostname']}) joined",
                    worker=worker_id,
                )
            )
            return
        if row[0] == WorkerState.OFFLINE.value:
            events.append(
                event_row("WorkerReturned", f"worker {worker_id} is back", worker=worker_id)
            )
        self._set(worker_id, **values)

    def write(self) -> None:
        """New workers, then the moved ones, one executemany per set of columns."""
        if self.new:
            self.conn.execute(_NEW_WORKER, list(self.new.values()))
        _write_grouped(self.conn, _SET_WORKER, self.changes.values())
        self.new.clear()
        self.changes.clear()


def rendezvous(conn: Connection, job_id: str, epoch: int, addr: str, port: int) -> None:
    done = conn.execute(_RENDEZVOUS, {"job": job_id, "epoch": epoch, "addr": addr, "port": port})
    if done.rowcount == 0:
        raise NotFound(f"job {job_id!r} has no epoch {epoch}")


def upsert_worker(
    conn: Connection,
    inventory: dict[str, Any],
    held_by: str | None,
    draining: bool,
    events: list[dict[str, Any]],
    now: datetime | None = None,
) -> None:
    """One inventory on its own (``WorkerStates.upsert``), written at once."""
    workers = WorkerStates(conn, [inventory["id"]])
    workers.upsert(inventory, held_by, draining, events, now)
    workers.write()


def worker_rows(conn: Connection) -> list[tuple[str, str, str]]:
    """Every worker's (id, state, inventory as JSON text), by id."""
    return [(str(i), str(state), str(data)) for i, state, data in conn.execute(_WORKER_VIEWS)]


def read_why_pending(conn: Connection, job_ids: Iterable[str]) -> dict[str, str | None]:
    """The current why_pending of each of ``job_ids`` that is queued."""
    ids = list(job_ids)
    current: dict[str, str | None] = {}
    for start in range(0, len(ids), WHY_PENDING_PER_READ):
        chunk = ids[start : start + WHY_PENDING_PER_READ]
        current.update((str(j), why) for j, why in conn.execute(WHY_PENDING, {"jobs": chunk}))
    return current


def why_pending_changes(
    current: Mapping[str, str | None], wanted: Mapping[str, str | None]
) -> dict[str, str | None]:
    """The jobs (of those queued) whose why_pending would change, with the new value."""
    return {job_id: wanted[job_id] for job_id, now in current.items() if now != wanted[job_id]}


def reason_gist(reason: str | None) -> str | None:
    """The kind of a why-pending reason: its first clause (counts move in the rest)."""
    return reason.split(";", 1)[0] if reason else None


def why_pending(
    conn: Connection,
    reasons: Mapping[str, str | None],
    events: list[dict[str, Any]],
    quiet: Collection[str] = (),
) -> int:
    """Write the queued jobs' reasons that changed; an "Unplaceable" event when the kind of
    a reason changes (its first clause), not each time a count in it moves, and not for the
    jobs in ``quiet`` (a kind they were told before): the column always holds the latest
    words. Returns how many changed."""
    previous = read_why_pending(conn, reasons)
    changes = why_pending_changes(previous, reasons)
    # Only the rows the UPDATE changed get an event: on PostgreSQL a reservation can commit
    # between the read above and the UPDATE, which then skips that job (no longer queued).
    written = _set_why_pending(conn, changes)
    events.extend(
        event_row("Unplaceable", reason, job=job_id)
        for job_id, reason in changes.items()
        if job_id in written
        and job_id not in quiet
        and reason
        and reason_gist(reason) != reason_gist(previous[job_id])
    )
    return len(written)


def _set_why_pending(conn: Connection, changes: Mapping[str, str | None]) -> set[str]:
    """Set each job's why_pending where it is still queued; the ids of the rows changed.

    The UPDATE locks each row it changes until the commit, so a job read again as queued
    right after it is one it changed; a job reserved in between is neither changed nor read.
    (One statement per row: a CASE over the chunk is quadratic in SQLite.)"""
    if not changes:
        return set()
    conn.execute(_SET_WHY_PENDING, [{"_job": j, "why": r} for j, r in changes.items()])
    return set(read_why_pending(conn, changes))


_CONDITION_NOW = select(CONDITIONS.c.status).where(
    CONDITIONS.c.job_id == bindparam("job"), CONDITIONS.c.type == bindparam("type")
)
_SET_CONDITION = update(CONDITIONS).where(
    CONDITIONS.c.job_id == bindparam("_job"), CONDITIONS.c.type == bindparam("_type")
)


def set_condition(
    conn: Connection, job_id: str, type_: str, status: bool | None, reason: str, message: str
) -> None:
    """Upsert a Kubernetes-style condition; its transition time moves when its status does."""
    text = "Unknown" if status is None else str(status)
    now = utcnow()
    current = conn.execute(_CONDITION_NOW, {"job": job_id, "type": type_}).scalar()
    if current is None:
        conn.execute(
            insert(CONDITIONS),
            {
                "job_id": job_id,
                "type": type_,
                "status": text,
                "reason": reason,
                "message": message,
                "last_transition": now,
            },
        )
        return
    values: dict[str, Any] = {"_job": job_id, "_type": type_, "status": text, "reason": reason}
    values["message"] = message
    if current != text:
        values["last_transition"] = now
    conn.execute(_SET_CONDITION, values)
