"""Workers: what agents offer, and their state as the scheduler reads it."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select, update

from muster.errors import NotFound
from muster.spec.states import WorkerState
from muster.spec.worker import WorkerInventory, WorkerView
from muster.store.base import Repository, add_event, utcnow
from muster.store.models import (
    Worker,
)


class WorkerRepository(Repository):
    # ---- workers -------------------------------------------------------------------------

    def upsert_worker(
        self,
        inv: WorkerInventory,
        now: datetime | None = None,
        *,
        held_by: str | None = None,
        draining: bool = False,
    ) -> Worker:
        """Record an agent's inventory and what the worker is free for.

        ``held_by``: a job whose member on this worker may still run (the worker stays
        busy with it); ``draining``: the agent still runs a member of a job that is over
        (busy, with no job) until an inventory without it says every process is gone.
        Otherwise the worker is idle.
        """
        now = now or utcnow()
        with self.db.transaction() as s:
            row = s.get(Worker, inv.id)
            data = inv.model_dump(mode="json")
            if row is None:
                row = Worker(
                    id=inv.id,
                    hostname=inv.hostname,
                    advertise_address=inv.advertise_address,
                    inventory=data,
                    state=WorkerState.IDLE.value,
                    joined_at=now,
                    last_seen=now,
                )
                s.add(row)
                add_event(
                    s, "WorkerJoined", f"worker {inv.id} ({inv.hostname}) joined", worker=inv.id
                )
            else:
                row.hostname, row.advertise_address = inv.hostname, inv.advertise_address
                row.inventory, row.last_seen = data, now
                if row.state == WorkerState.OFFLINE.value:
                    add_event(s, "WorkerReturned", f"worker {inv.id} is back", worker=inv.id)
            held = (WorkerState.RESERVED.value, WorkerState.BUSY.value)
            if held_by is not None:
                if not (row.job_id == held_by and row.state in held):
                    row.state, row.job_id = WorkerState.BUSY.value, held_by
            elif draining:
                row.state, row.job_id = WorkerState.BUSY.value, None
            else:  # nothing of any job runs there, as the controller and the agent see it
                row.state, row.job_id = WorkerState.IDLE.value, None
            return row

    def mark_all_offline(self) -> None:
        """At controller start no agent is connected yet; each becomes idle when it dials in."""
        with self.db.transaction() as s:
            s.execute(update(Worker).values(state=WorkerState.OFFLINE.value, job_id=None))

    def set_worker_state(self, worker_id: str, state: WorkerState) -> None:
        with self.db.transaction() as s:
            row = s.get(Worker, worker_id)
            if row is None:
                raise NotFound(f"worker {worker_id!r} does not exist; see `muster get workers`")
            row.state = state.value
            if state in (WorkerState.IDLE, WorkerState.OFFLINE):
                row.job_id = None

    def workers(self) -> list[WorkerView]:
        """The scheduler's snapshot: every worker's inventory and state."""
        with self.db.read() as s:
            rows = s.scalars(select(Worker).order_by(Worker.id)).all()
            return [
                WorkerView(
                    inventory=WorkerInventory.model_validate(r.inventory, strict=False),
                    state=WorkerState(r.state),
                )
                for r in rows
            ]

    def worker_rows(self) -> list[Worker]:
        with self.db.read() as s:
            return list(s.scalars(select(Worker).order_by(Worker.id)))
