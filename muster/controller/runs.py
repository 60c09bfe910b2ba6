"""The runs the controller tracks, and how one is rebuilt from the store after a restart."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from muster.gang import GangRun, MemberSnapshot
from muster.plan import GangAddressing, gang_addressing, mesh_gang_of
from muster.spec import JobSpec, JobState, MemberState, PathClass, WorkerInventory
from muster.store.jobs import RunRecord


@dataclass
class RunEntry:
    """One tracked gang run (``muster.gang``) and what the controller needs to apply it."""

    gang: GangRun
    spec: JobSpec
    inventories: list[WorkerInventory]
    bundle: str | None
    addressing: GangAddressing | None = None
    mesh: int = 0  # the direct path's mesh gang index (muster.plan.mesh_address)


def rebuild_run(rec: RunRecord, inventories: dict[str, WorkerInventory]) -> RunEntry:
    """A job caught mid-run, as the store holds it (step ``ControllerRestarted`` on it next).
    Raises ValueError (the spec no longer validates) or KeyError (a member's worker is gone)."""
    spec = JobSpec.model_validate(rec.job.spec, strict=False)
    members = [inventories[m.worker_id] for m in rec.members]
    path = PathClass(rec.epoch.path_class)
    published = None
    if rec.epoch.master_addr and rec.epoch.master_port:
        published = (rec.epoch.master_addr, rec.epoch.master_port)
    mesh = 0
    if path is PathClass.DIRECT and published is not None and len(members) > 1:
        mesh = mesh_gang_of(published[0])  # node 0's mesh address
    created_at = rec.epoch.created_at
    if created_at.tzinfo is None:  # SQLite gives naive datetimes; muster's are UTC
        created_at = created_at.replace(tzinfo=datetime.UTC)
    created = created_at.timestamp()
    gang = GangRun.restore(
        rec.job.id,
        rec.epoch.number,
        path,
        JobState(rec.job.state),
        [
            MemberSnapshot(
                worker=m.worker_id,
                state=MemberState(m.state),
                exit_code=m.exit_code,
                outputs=True if m.node_rank in rec.outputs_stored else None,
                released=MemberState(m.state).is_terminal,
                assigned=m.assigned_at is not None,
            )
            for m in rec.members
        ],
        master_addr=gang_addressing(path, members, 0, mesh).master_addr,
        port=spec.gang.rendezvous.port,
        published=published,
        timeout=spec.timeout or None,
        deadline=created + spec.timeout if spec.timeout else None,
    )
    entry = RunEntry(gang, spec, members, rec.job.bundle_sha256, mesh=mesh)
    if published is not None:
        entry.addressing = gang_addressing(path, members, published[1], mesh)
    return entry
