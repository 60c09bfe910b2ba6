"""The runs the controller tracks, and how one is rebuilt from the store after a restart."""

from __future__ import annotations

import dataclasses
import datetime
import hmac
import secrets
import time
from dataclasses import dataclass, field

from muster.gang import GangRun, MemberSnapshot
from muster.plan import GangAddressing, gang_addressing, mesh_gang_of
from muster.spec import JobSpec, JobState, MemberState, PathClass, WorkerInventory
from muster.store.jobs import RunRecord

JOIN_KEY_TTL_S = 15 * 60.0  # a member's join key is good this long after NET_SETUP


@dataclass
class JoinKeys:
    """The single-use keys with which an epoch's members join its network: NET_SETUP
    carries a fresh one to each member, and its NET_READY must bring it back, once, within
    JOIN_KEY_TTL_S. Kept in the controller's memory only (never stored, never logged)."""

    epoch: int
    issued: dict[int, tuple[str, float]] = field(default_factory=dict)  # node -> (key, expiry)
    used: set[int] = field(default_factory=set)

    def issue(self, node: int, now: float | None = None) -> str:
        key = secrets.token_urlsafe(24)
        expiry = (time.time() if now is None else now) + JOIN_KEY_TTL_S
        self.issued[node] = (key, expiry)
        self.used.discard(node)
        return key

    def redeem(self, node: int, key: object, now: float | None = None) -> str | None:
        """None when ``key`` is node's unused, unexpired key (it is now used); else why not."""
        issued = self.issued.get(node)
        if issued is None:
            return f"no join key was issued to node{node} in epoch {self.epoch}"
        expected, expiry = issued
        if not isinstance(key, str) or not hmac.compare_digest(key.encode(), expected.encode()):
            return f"node{node} presented a join key that is not its key for epoch {self.epoch}"
        if node in self.used:
            return f"node{node} presented its epoch {self.epoch} join key again (single use)"
        if (time.time() if now is None else now) > expiry:
            stamp = datetime.datetime.fromtimestamp(expiry, datetime.UTC).strftime("%H:%M:%S")
            return (
                f"node{node} presented an expired join key (epoch {self.epoch}; expired "
                f"{stamp} UTC, {JOIN_KEY_TTL_S / 60:.0f} min after it was issued)"
            )
        self.used.add(node)
        return None


@dataclass
class RunEntry:
    """One tracked gang run (``muster.gang``) and what the controller needs to apply it."""

    gang: GangRun
    spec: JobSpec
    inventories: list[WorkerInventory]
    bundle: str | None
    addressing: GangAddressing | None = None
    mesh: int = 0  # the direct path's mesh gang index (muster.plan.mesh_address)
    join_keys: JoinKeys | None = None  # the epoch's, issued with its NET_SETUPs
    offered_mtu: int = 0  # the direct path's MTU its NET_SETUPs offered (0: none sent yet)
    # The epoch's probe token: a probe endpoint answers only connections that bring it.
    probe_token: str = field(default_factory=lambda: secrets.token_hex(16))


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
    # The hang watch's settings (its state comes back with the agents' HUNG reports).
    gang = dataclasses.replace(
        gang, fail_on_hang=spec.on_hang == "fail", hang_timeout=spec.hang_timeout
    )
    entry = RunEntry(gang, spec, members, rec.job.bundle_sha256, mesh=mesh)
    if published is not None:
        entry.addressing = gang_addressing(path, members, published[1], mesh)
    return entry
