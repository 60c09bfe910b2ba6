"""The plain linear-scan placement: every decision walks every worker.

It applies the same rules as ``place_gang`` written the obvious way, without the kind index.
It is the reference the indexed scheduler is property-tested against and the baseline
``bench/scheduler.py`` measures it against; muster itself never calls it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from muster.scheduler.place import Need, Placement, kind_problem
from muster.scheduler.pool import WorkerKind
from muster.spec.job import JobSpec
from muster.spec.network import PathClass
from muster.spec.states import WorkerState
from muster.spec.worker import WorkerInventory, WorkerView


def linear_place(spec: JobSpec, workers: Sequence[WorkerView]) -> Placement | None:
    """The best gang by the documented preference order, or None when none fits."""
    need = Need.of(spec)
    fit: list[tuple[WorkerKind, WorkerInventory]] = []
    for view in workers:
        if view.state is not WorkerState.IDLE:
            continue
        kind = WorkerKind.of(view.inventory)
        if kind_problem(kind, need) is None:
            fit.append((kind, view.inventory))
    if need.workers == 1:
        return _best(PathClass.PRIVATE, fit, need) if fit else None
    groups: dict[tuple[object, ...], list[tuple[WorkerKind, WorkerInventory]]] = defaultdict(list)
    for kind, inv in fit:
        vendor = (kind.gpu_vendor or "") if need.backend == "nccl" else ""
        if need.network == "colocated":
            where: tuple[str, ...] = (kind.provider, kind.region)
        elif need.network == "regional":
            where = (kind.region_class,)
        else:
            where = ()
        groups[(kind.torch_version or "", vendor, where)].append((kind, inv))
    options: list[tuple[tuple[object, ...], Placement]] = []
    for key, members in groups.items():
        private: dict[tuple[str, str, str], list[tuple[WorkerKind, WorkerInventory]]] = defaultdict(
            list
        )
        for kind, inv in members:
            if kind.private_network_id is not None:
                private[(kind.provider, kind.region, kind.private_network_id)].append((kind, inv))
        for sub_key, sub in private.items():
            if len(sub) >= need.workers:
                options.append(
                    (
                        (PathClass.PRIVATE.relative_cost, *key, *sub_key),
                        _best(PathClass.PRIVATE, sub, need),
                    )
                )
        direct = [(k, i) for k, i in members if k.can_create_device]
        if len(direct) >= need.workers:
            options.append(
                ((PathClass.DIRECT.relative_cost, *key), _best(PathClass.DIRECT, direct, need))
            )
        elif need.transport == "auto":
            # Relayed members are reached at their own advertise address: one per address.
            ordered = sorted(members, key=lambda m: _order(m, need))
            distinct: dict[str, tuple[WorkerKind, WorkerInventory]] = {}
            for kind, inv in ordered:
                distinct.setdefault(inv.advertise_address or "", (kind, inv))
            if len(distinct) >= need.workers:
                best = _best(PathClass.RELAYED, list(distinct.values()), need)
                options.append(((PathClass.RELAYED.relative_cost, *key), best))
    if not options:
        return None
    return min(options, key=lambda option: option[0])[1]


def _best(
    path: PathClass, members: list[tuple[WorkerKind, WorkerInventory]], need: Need
) -> Placement:
    ordered = sorted(members, key=lambda m: _order(m, need))
    chosen = sorted((inv for _, inv in ordered[: need.workers]), key=lambda inv: inv.id)
    return Placement(path, tuple(chosen))


def _order(member: tuple[WorkerKind, WorkerInventory], need: Need) -> tuple[object, ...]:
    kind, inv = member
    return (kind.gpu_count - need.gpus, kind.sort_key, inv.id)
