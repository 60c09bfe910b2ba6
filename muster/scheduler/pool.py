"""An indexed snapshot of the worker pool, so one placement costs the kinds, not the workers.

Workers that look the same to the scheduler (torch version, launcher, backends, GPUs,
address or not, provider/region/region class, network capabilities) form one ``WorkerKind``.
A pool of 10,000 machines has a few hundred kinds; every decision walks kinds and only
the chosen gang touches worker ids. ``take`` and ``give_back`` apply a decision to the
index; they never change a decision already made.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple

from muster.spec.states import WorkerState
from muster.spec.worker import WorkerInventory, WorkerView


class WorkerKind(NamedTuple):
    """Every attribute a placement decision reads; workers of one kind are interchangeable."""

    torch_version: str | None
    torchrun: bool
    backends: frozenset[str]
    gpu_count: int
    gpu_vendor: str | None
    has_address: bool
    provider: str
    region: str
    region_class: str
    private_network_id: str | None
    can_create_device: bool
    container_only: bool

    @staticmethod
    def of(inv: WorkerInventory) -> WorkerKind:
        net = inv.network
        return WorkerKind(
            torch_version=inv.torch_version,
            torchrun=inv.torchrun,
            backends=frozenset(inv.backends),
            gpu_count=inv.gpus.count,
            gpu_vendor=inv.gpus.vendor,
            has_address=bool(inv.advertise_address),
            provider=inv.provider,
            region=inv.region,
            region_class=inv.region_class,
            private_network_id=net.private_network_id,
            can_create_device=net.can_create_device,
            container_only=net.container_only,
        )

    @property
    def sort_key(self) -> tuple[str, ...]:
        """A total order over kinds, so every choice between them is deterministic."""
        return _sort_key(self)


@lru_cache(maxsize=65536)
def _sort_key(kind: WorkerKind) -> tuple[str, ...]:
    return tuple(",".join(sorted(v)) if isinstance(v, frozenset) else str(v) for v in kind)


@dataclass
class KindSlot:
    """The idle workers of one kind, in id order."""

    kind: WorkerKind
    ids: dict[str, None] = field(default_factory=dict)  # insertion-ordered set
    in_use: int = 0  # reserved or busy now; idle again when their jobs end

    @property
    def idle(self) -> int:
        return len(self.ids)


class PoolIndex:
    """Idle workers grouped by kind, plus counts of the ones that are not idle."""

    def __init__(self, workers: Iterable[WorkerView | WorkerInventory] = ()) -> None:
        self.slots: dict[WorkerKind, KindSlot] = {}
        self.inventory: dict[str, WorkerInventory] = {}
        self.kind_of: dict[str, WorkerKind] = {}
        self.not_idle: dict[WorkerState, int] = {}
        self.version = 0  # moves on every take/give_back: what was explained before is stale
        # Private addresses held by gangs on the private path (running, or placed in this
        # pass): a gang's rules tell members from others by address, so no other gang may
        # take the private path on a worker at one of them (IPCollision). Loopback never.
        self.private_taken: set[str] = set()
        # Advertise addresses held by running relayed gangs: a relayed member is reached at
        # its own address, so no second relayed gang may route one (IPCollision).
        self.relayed_taken: set[str] = set()
        views = [w if isinstance(w, WorkerView) else WorkerView(inventory=w) for w in workers]
        for view in sorted(views, key=lambda v: v.id):
            if view.state is WorkerState.IDLE:
                self._add_idle(view.inventory)
            else:
                self.not_idle[view.state] = self.not_idle.get(view.state, 0) + 1
                if view.state is not WorkerState.OFFLINE:
                    self._slot(WorkerKind.of(view.inventory)).in_use += 1

    def _slot(self, kind: WorkerKind) -> KindSlot:
        slot = self.slots.get(kind)
        if slot is None:
            slot = self.slots[kind] = KindSlot(kind)
        return slot

    def _add_idle(self, inv: WorkerInventory) -> None:
        kind = WorkerKind.of(inv)
        self._slot(kind).ids[inv.id] = None
        self.inventory[inv.id] = inv
        self.kind_of[inv.id] = kind

    @property
    def idle_count(self) -> int:
        return sum(slot.idle for slot in self.slots.values())

    @property
    def total(self) -> int:
        return self.idle_count + sum(self.not_idle.values())

    def take(self, worker_ids: Iterable[str]) -> None:
        """Mark workers reserved: they leave the idle index."""
        self.version += 1
        for wid in worker_ids:
            kind = self.kind_of[wid]
            slot = self.slots[kind]
            del slot.ids[wid]
            slot.in_use += 1
            self.not_idle[WorkerState.RESERVED] = self.not_idle.get(WorkerState.RESERVED, 0) + 1

    def hold_private(self, addresses: Iterable[str | None]) -> None:
        """A gang across hosts holds these private addresses (see ``private_taken``)."""
        self.version += 1
        for address in addresses:
            if address and not address.startswith("127.") and address != "::1":
                self.private_taken.add(address)

    def hold_relayed(self, addresses: Iterable[str | None]) -> None:
        """A relayed gang holds these advertise addresses (see ``relayed_taken``)."""
        self.version += 1
        self.relayed_taken.update(a for a in addresses if a)

    def relayed_blocked(self, worker_id: str) -> bool:
        """Whether the worker's advertise address is a running relayed gang's."""
        return self.inventory[worker_id].advertise_address in self.relayed_taken

    def private_blocked(self, worker_id: str) -> bool:
        """Whether the worker's private address is another gang's (see ``private_taken``)."""
        if not self.private_taken:
            return False
        return self.inventory[worker_id].network.private_address in self.private_taken

    def give_back(self, worker_ids: Iterable[str]) -> None:
        """Return reserved workers to the idle index (a placement that was not applied)."""
        self.version += 1
        for wid in worker_ids:
            kind = self.kind_of[wid]
            slot = self.slots[kind]
            slot.ids = dict.fromkeys(sorted([*slot.ids, wid]))
            slot.in_use -= 1
            self.not_idle[WorkerState.RESERVED] -= 1
