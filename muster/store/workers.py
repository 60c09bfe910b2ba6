"""Workers: what agents offer, and their state as the scheduler reads it."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import orjson
from sqlalchemy import select, update

from muster.errors import NotFound
from muster.spec.states import WorkerState
from muster.spec.worker import WorkerInventory, WorkerView
from muster.store import hot
from muster.store.base import Repository
from muster.store.engine import Database
from muster.store.models import (
    Worker,
)


class WorkerRepository(Repository):
    def __init__(self, db: Database) -> None:
        super().__init__(db)
        # worker id -> (inventory JSON, validated): see ``workers``
        self._validated: dict[str, tuple[str, WorkerInventory]] = {}

    # ---- workers -------------------------------------------------------------------------

    def upsert_worker(
        self,
        inv: WorkerInventory,
        now: datetime | None = None,
        *,
        held_by: str | None = None,
        draining: bool = False,
    ) -> None:
        """Record an agent's inventory and what the worker is free for.

        ``held_by``: a job whose member on this worker may still run (the worker stays
        busy with it); ``draining``: the agent still runs a member of a job that is over
        (busy, with no job) until an inventory without it says every process is gone.
        Otherwise the worker is idle.
        """
        events: list[dict[str, Any]] = []
        with self.db.transaction() as s:
            conn = s.connection()
            hot.upsert_worker(conn, inv.model_dump(mode="json"), held_by, draining, events, now)
            hot.insert_events(conn, events)

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
        """The scheduler's snapshot: every worker's inventory and state. An inventory is
        validated once per content (a pass reads every worker, and they rarely change)."""
        with self.db.read() as s:
            rows = hot.worker_rows(s.connection())
        known = self._validated
        fresh: dict[str, tuple[str, WorkerInventory]] = {}
        views = []
        for worker_id, state, data in rows:
            cached = known.get(worker_id)
            if cached is None or cached[0] != data:
                inventory = WorkerInventory.model_validate(orjson.loads(data), strict=False)
                cached = (data, inventory)
            fresh[worker_id] = cached
            views.append(WorkerView(inventory=cached[1], state=WorkerState(state)))
        self._validated = fresh  # swapped whole: callers in other threads see one or the other
        return views

    def worker_rows(self) -> list[Worker]:
        with self.db.read() as s:
            return list(s.scalars(select(Worker).order_by(Worker.id)))
