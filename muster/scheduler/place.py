"""Gang placement: N distinct idle workers at once, or none, with one path class (seeds 000, 001).

``place_gang(spec, snapshot)`` is a pure decision: the same snapshot gives the same answer.

A gang of N > 1 needs N idle workers that
  - each have torch, the torchrun launcher, the job's backend, an advertise address, and
    at least ``resources.gpus`` GPUs (``procs_per_worker`` never exceeds it; see spec rules);
  - share one torch version and, under nccl, one GPU vendor;
  - sit inside the network class: colocated = one provider region, regional = one region
    class (any provider), global = anywhere;
  - can all take one path class: private (one provider region, one private network),
    direct (every member can create a WireGuard device) or, only with transport auto,
    relayed (some member is container-only or cannot make a device).
Candidates are compared by the path's relative cost (private < direct; relayed counts 4x
direct), then by a fixed order of their attributes, so the answer is deterministic.
Inside the winning group the workers whose GPU count fits the job most tightly go first,
then by worker id. A gang of one needs no network and always gets the private class.
On the private path a worker whose private address another gang across hosts holds (two
agents on one host share it) is passed over: the gangs' rules know members by address
(``PoolIndex.private_taken``; IPCollision in the reason when nothing else fits).

A job whose earlier epoch failed its network (a pair the probe could not cross, a direct
path with no handshake) carries the pairs to keep apart, per path class (``Apart``): its
next gang on that path never holds both workers of such a pair, so a private pair that
failed is placed direct, and a direct pair that failed is split.
"""

from __future__ import annotations

import weakref
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from muster.scheduler.pool import PoolIndex, WorkerKind
from muster.spec.job import JobSpec
from muster.spec.network import NetworkClass, PathClass, Transport
from muster.spec.worker import WorkerInventory, WorkerView

#: Per path class, the worker pairs one gang on that path must not hold together.
Apart = Mapping[PathClass, frozenset[frozenset[str]]]


class Need(NamedTuple):
    """What a job asks of the pool; jobs with the same Need share cached groups."""

    workers: int
    backend: str
    gpus: int
    device: str
    network: NetworkClass
    transport: Transport

    @staticmethod
    def of(spec: JobSpec) -> Need:
        gang = spec.gang
        return Need(
            workers=gang.num_workers,
            backend=spec.backend,
            gpus=spec.resources.gpus,
            device=spec.resources.effective_device,
            network=gang.network,
            transport=gang.transport,
        )

    def describe(self) -> str:
        parts = ["one torch version", "torchrun", self.backend]
        if self.gpus:
            parts.append(
                f">= {self.gpus} GPUs" + (" of one vendor" if self.backend == "nccl" else "")
            )
        if self.workers > 1:
            parts.append("an advertise address")
            parts.append(
                {
                    "colocated": "in one provider region",
                    "regional": "in one region class",
                    "global": "anywhere",
                }[self.network]
            )
            parts.append("a private or direct path" if self.transport == "direct" else "any path")
        noun = "worker" if self.workers == 1 else "workers"
        return f"needs {self.workers} idle {noun} with " + ", ".join(parts)


@dataclass(frozen=True)
class Placement:
    """The chosen gang: ``members[r]`` is node rank r."""

    path: PathClass
    members: tuple[WorkerInventory, ...]

    @property
    def worker_ids(self) -> tuple[str, ...]:
        return tuple(m.id for m in self.members)


@dataclass(frozen=True)
class Unplaceable:
    """Why no gang fits now; ``reason`` is the job's "why pending" line."""

    reason: str
    ruled_out: tuple[tuple[str, int], ...] = ()
    needs_path: PathClass | None = None  # enough workers, but only on a path not set up


def kind_problem(kind: WorkerKind, need: Need) -> str | None:
    """Why one worker of this kind can never be a member of this job's gang, or None."""
    if kind.torch_version is None:
        return "lack torch"
    if not kind.torchrun:
        return "lack the torchrun launcher"
    if need.backend not in kind.backends:
        return f"lack {need.backend}"
    if need.gpus and kind.gpu_count < need.gpus:
        return f"have fewer than {need.gpus} GPUs"
    if need.device == "cuda" and kind.gpu_vendor not in ("nvidia", "amd"):
        return "have no CUDA (or ROCm) GPUs"
    if need.workers > 1:
        if not kind.has_address:
            return "have no advertise address"
        if need.transport == "direct" and not (
            kind.can_create_device or kind.private_network_id is not None
        ):
            what = "are container-only" if kind.container_only else "cannot create a device"
            return f"{what} and share no private network (transport: auto allows relayed)"
    return None


class _Group:
    """Kinds that can form one gang together on one path."""

    __slots__ = ("kinds", "label", "path", "sort_key")

    def __init__(
        self, path: PathClass, label: str, sort_key: tuple[object, ...], kinds: list[WorkerKind]
    ) -> None:
        self.path = path
        self.label = label
        self.sort_key = sort_key
        self.kinds = kinds


@dataclass
class _NeedIndex:
    eligible: set[WorkerKind]
    problems: dict[WorkerKind, str]
    groups: list[_Group]


class GroupCache:
    """Per-Need candidate groups over a PoolIndex. Kinds never change after the index is
    built (take/give_back only move worker ids), so the groups stay valid; idle counts are
    read from the pool when a decision is made."""

    _caches: ClassVar[weakref.WeakKeyDictionary[PoolIndex, GroupCache]] = (
        weakref.WeakKeyDictionary()
    )

    def __init__(self, pool: PoolIndex) -> None:
        self.pool = pool
        self.needs: dict[Need, _NeedIndex] = {}
        # (need, held kinds, pool version) -> why a gang of that need does not fit now
        self.explained: dict[tuple[Need, frozenset[WorkerKind], int], Unplaceable] = {}

    @classmethod
    def of(cls, pool: PoolIndex) -> GroupCache:
        cache = cls._caches.get(pool)
        if cache is None:
            cache = cls._caches[pool] = GroupCache(pool)
        return cache

    def index(self, need: Need) -> _NeedIndex:
        # Eligibility and groups depend on the gang size only through "one or more than
        # one", so gangs of 2..N share one entry.
        key = need._replace(workers=min(need.workers, 2))
        found = self.needs.get(key)
        if found is None:
            found = self.needs[key] = self._build(key)
        return found

    def _build(self, need: Need) -> _NeedIndex:
        problems: dict[WorkerKind, str] = {}
        eligible: set[WorkerKind] = set()
        for kind in self.pool.slots:
            problem = kind_problem(kind, need)
            if problem is None:
                eligible.add(kind)
            else:
                problems[kind] = problem
        # Tightest GPU fit first, then the kinds' fixed order: the order _pick takes them in.
        ordered = sorted(eligible, key=lambda k: (k.gpu_count - need.gpus, k.sort_key))
        return _NeedIndex(eligible, problems, _candidate_groups(ordered, need))


def _network_key(kind: WorkerKind, network: NetworkClass) -> tuple[str, ...]:
    if network == "colocated":
        return (kind.provider, kind.region)
    if network == "regional":
        return (kind.region_class,)
    return ()


def _network_label(key: tuple[str, ...], network: NetworkClass) -> str:
    if network == "colocated":
        return f"region {key[0]}/{key[1]}"
    if network == "regional":
        return f"region class {key[0]}"
    return "any region"


def _candidate_groups(kinds: list[WorkerKind], need: Need) -> list[_Group]:
    if need.workers == 1:
        return [_Group(PathClass.PRIVATE, "one worker", (), kinds)] if kinds else []
    partitions: dict[tuple[str, str, tuple[str, ...]], list[WorkerKind]] = defaultdict(list)
    for kind in kinds:
        vendor = (kind.gpu_vendor or "") if need.backend == "nccl" else ""
        key = (kind.torch_version or "", vendor, _network_key(kind, need.network))
        partitions[key].append(kind)
    groups: list[_Group] = []
    for (torch, vendor, net), members in partitions.items():
        where = f"torch {torch}" + (f", {vendor}" if vendor else "")
        where += f", {_network_label(net, need.network)}"
        base = (torch, vendor, net)
        private: dict[tuple[str, str, str], list[WorkerKind]] = defaultdict(list)
        for kind in members:
            if kind.private_network_id is not None:
                private[(kind.provider, kind.region, kind.private_network_id)].append(kind)
        for (provider, region, net_id), sub in private.items():
            label = f"{where}, private network {net_id} in {provider}/{region}"
            groups.append(_Group(PathClass.PRIVATE, label, (*base, provider, region, net_id), sub))
        direct = [k for k in members if k.can_create_device]
        if direct:
            groups.append(_Group(PathClass.DIRECT, where, base, direct))
        if need.transport == "auto":
            groups.append(_Group(PathClass.RELAYED, where, base, members))
    groups.sort(key=lambda g: (g.path.relative_cost, g.sort_key))
    return groups


def _screened(group: _Group, pool: PoolIndex, need: Need) -> bool:
    """Whether the group's workers must be screened for another gang's private address
    (a gang of one needs no network: never)."""
    return group.path is PathClass.PRIVATE and need.workers > 1 and bool(pool.private_taken)


def _available(
    group: _Group,
    pool: PoolIndex,
    exclude: frozenset[WorkerKind],
    enough: int | None = None,
    *,
    screen: bool = False,
) -> int:
    """Idle workers in the group outside ``exclude`` (and with ``screen``, not at another
    gang's private address); stops counting at ``enough``."""
    total = 0
    slots = pool.slots
    for kind in group.kinds:
        if kind not in exclude:
            ids = slots[kind].ids
            total += sum(1 for w in ids if not pool.private_blocked(w)) if screen else len(ids)
            if enough is not None and total >= enough:
                break
    return total


ALL_PATHS = frozenset(PathClass)
IP_COLLISION = "IPCollision"  # the clause of a reason, and the GangReady reason it sets


def place_gang(
    spec: JobSpec,
    snapshot: PoolIndex | Sequence[WorkerView | WorkerInventory],
    *,
    exclude: frozenset[WorkerKind] = frozenset(),
    paths: frozenset[PathClass] = ALL_PATHS,
    apart: Apart | None = None,
) -> Placement | Unplaceable:
    """Choose the job's whole gang from the snapshot's idle workers, or say why none fits.

    ``exclude`` holds worker kinds that jobs earlier in the queue are waiting for;
    ``paths`` the path classes the controller can set up now. A gang that could only be
    formed on another path stays unplaced, and the reason names the path it would need.
    ``apart``: the pairs this job's gang must not hold together on a path (see above).
    """
    pool = snapshot if isinstance(snapshot, PoolIndex) else PoolIndex(snapshot)
    need = Need.of(spec)
    index = GroupCache.of(pool).index(need)
    blocked: _Group | None = None
    for group in index.groups:  # already in preference order
        pairs = apart.get(group.path) if apart else None
        if group.path is PathClass.RELAYED and need.workers > 1:
            picked = _pick_relayed(group, pool, need, exclude, pairs or frozenset())
            if picked is not None:
                if group.path in paths:
                    return Placement(group.path, picked)
                blocked = blocked or group
            continue
        if pairs:
            chosen = _pick_apart(group, pool, need, exclude, pairs)
            if chosen is None:
                continue
            if group.path in paths:
                return Placement(group.path, chosen)
            blocked = blocked or group
        elif (
            _available(group, pool, exclude, need.workers, screen=_screened(group, pool, need))
            >= need.workers
        ):
            if group.path in paths:
                return Placement(group.path, _pick(group, pool, need, exclude))
            blocked = blocked or group
    if blocked is not None:
        can = ", ".join(sorted(p.value for p in paths)) or "none"
        return Unplaceable(
            f"{need.describe()}; enough idle workers ({blocked.label}) could form the gang "
            f"only on the {blocked.path.value} path, which this controller cannot set up "
            f"yet (it sets up: {can}); the job waits for workers that share a private network",
            needs_path=blocked.path,
        )
    if apart and any(apart.values()):
        reason, ruled_out = _explain(need, pool, index, exclude)
        kept = sorted((path.value, sorted(pair)) for path, pairs in apart.items() for pair in pairs)
        shown = "; ".join(f"{a} and {b} not on the {path} path" for path, (a, b) in kept[:4])
        more = f" and {len(kept) - 4} more" if len(kept) > 4 else ""
        return Unplaceable(
            f"{reason}; kept apart after an epoch whose network failed: {shown}{more}",
            ruled_out,
        )
    # Jobs of one need explained against the same pool get the same words: explain once.
    cache = GroupCache.of(pool).explained
    key = (need, exclude, pool.version)
    found = cache.get(key)
    if found is None:
        reason, ruled_out = _explain(need, pool, index, exclude)
        collided = _collisions(index, pool, exclude, need)
        if collided:
            reason += (
                f"; {IP_COLLISION}: {collided} idle worker(s) on a private network share an "
                "address with a gang running on the private path there (one gang per address)"
            )
        elif need.workers > 1 and _relayed_collisions(index, pool, exclude, need):
            reason += (
                f"; {IP_COLLISION}: the relayed path's idle workers are at addresses a running "
                "relayed gang routes (each member is reached at its own address)"
            )
        found = cache[key] = Unplaceable(reason, ruled_out)
    return found


def _pick_relayed(
    group: _Group,
    pool: PoolIndex,
    need: Need,
    exclude: frozenset[WorkerKind],
    pairs: frozenset[frozenset[str]],
    *,
    screen: bool = True,
) -> tuple[WorkerInventory, ...] | None:
    """A relayed gang: members reached at their own advertise addresses, so no two at one
    address, none at an address a running relayed gang routes (with ``screen``), and no
    pair kept apart; in pick order. None when the group has no such gang."""
    chosen: list[str] = []
    addresses: set[str] = set()
    for kind in group.kinds:
        if kind in exclude:
            continue
        for wid in pool.slots[kind].ids:
            address = pool.inventory[wid].advertise_address or ""
            if address in addresses or (screen and pool.relayed_blocked(wid)):
                continue
            if any(frozenset((wid, other)) in pairs for other in chosen):
                continue
            chosen.append(wid)
            addresses.add(address)
            if len(chosen) == need.workers:
                return tuple(pool.inventory[w] for w in sorted(chosen))
    return None


def _relayed_collisions(
    index: _NeedIndex, pool: PoolIndex, exclude: frozenset[WorkerKind], need: Need
) -> bool:
    """A relayed group would form the gang but for addresses running relayed gangs hold."""
    return bool(pool.relayed_taken) and any(
        group.path is PathClass.RELAYED
        and _pick_relayed(group, pool, need, exclude, frozenset(), screen=True) is None
        and _pick_relayed(group, pool, need, exclude, frozenset(), screen=False) is not None
        for group in index.groups
    )


def _collisions(
    index: _NeedIndex, pool: PoolIndex, exclude: frozenset[WorkerKind], need: Need
) -> int:
    """The idle workers another gang's addresses took from a private group that would form
    the gang without them (0 when that is not why it waits)."""
    most = 0
    for group in index.groups:
        if not _screened(group, pool, need):
            continue
        whole = _available(group, pool, exclude)
        if whole >= need.workers > _available(group, pool, exclude, screen=True):
            most = max(most, whole - _available(group, pool, exclude, screen=True))
    return most


def _pick(
    group: _Group, pool: PoolIndex, need: Need, exclude: frozenset[WorkerKind]
) -> tuple[WorkerInventory, ...]:
    chosen: list[str] = []
    screen = _screened(group, pool, need)
    for kind in group.kinds:  # already in pick order (see GroupCache._build)
        if kind in exclude:
            continue
        for wid in pool.slots[kind].ids:
            if screen and pool.private_blocked(wid):
                continue
            chosen.append(wid)
            if len(chosen) == need.workers:
                return tuple(pool.inventory[w] for w in sorted(chosen))
    raise AssertionError("group had fewer idle workers than counted")  # pragma: no cover


def _pick_apart(
    group: _Group,
    pool: PoolIndex,
    need: Need,
    exclude: frozenset[WorkerKind],
    pairs: frozenset[frozenset[str]],
) -> tuple[WorkerInventory, ...] | None:
    """Like ``_pick``, but never both workers of a pair in ``pairs``: workers in no such pair
    first (in pick order), then the fewest needed of the others, found by a bounded search
    (fewest conflicts first); None when no such gang exists (or none was found in bounds)."""
    screen = _screened(group, pool, need)
    order = [
        w
        for kind in group.kinds
        if kind not in exclude
        for w in pool.slots[kind].ids
        if not (screen and pool.private_blocked(w))
    ]
    here = set(order)
    conflicts: dict[str, set[str]] = {}
    for pair in pairs:
        if pair <= here and len(pair) == 2:
            a, b = tuple(pair)
            conflicts.setdefault(a, set()).add(b)
            conflicts.setdefault(b, set()).add(a)
    free = [w for w in order if w not in conflicts]
    if len(free) >= need.workers:
        chosen = free[: need.workers]
    else:
        rest = sorted(conflicts, key=lambda w: (len(conflicts[w]), order.index(w)))
        found = _independent(rest, conflicts, need.workers - len(free))
        if found is None:
            return None
        chosen = free + found
    return tuple(pool.inventory[w] for w in sorted(chosen))


APART_SEARCH_STEPS = 20_000  # a bound on the search for workers that are pairwise apart


def _independent(nodes: list[str], conflicts: dict[str, set[str]], k: int) -> list[str] | None:
    """``k`` of ``nodes`` no two of which conflict, or None (depth-first, bounded)."""
    steps = 0
    stack: list[tuple[int, list[str]]] = [(0, [])]
    while stack:
        i, chosen = stack.pop()
        if len(chosen) == k:
            return chosen
        steps += 1
        if steps > APART_SEARCH_STEPS or len(nodes) - i < k - len(chosen):
            continue
        node = nodes[i]
        stack.append((i + 1, chosen))  # without it (tried second)
        if not conflicts[node].intersection(chosen):
            stack.append((i + 1, [*chosen, node]))  # with it (tried first)
    return None


def _explain(
    need: Need, pool: PoolIndex, index: _NeedIndex, exclude: frozenset[WorkerKind]
) -> tuple[str, tuple[tuple[str, int], ...]]:
    head = need.describe()
    idle = pool.idle_count
    if pool.total == 0:
        return f"{head}; no workers have joined", ()
    others = ", ".join(f"{n} {s.value}" for s, n in sorted(pool.not_idle.items()) if n)
    idle_part = f"{idle} of {pool.total} workers idle" + (f" ({others})" if others else "")
    ruled: Counter[str] = Counter()
    for kind, problem in index.problems.items():
        ruled[problem] += pool.slots[kind].idle
    ruled_out = tuple((p, n) for p, n in sorted(ruled.items(), key=lambda i: (-i[1], i[0])) if n)
    parts = [head, idle_part]
    if ruled_out:
        parts.append(", ".join(f"{n} {p}" for p, n in ruled_out))
    matching = sum(pool.slots[k].idle for k in index.eligible)
    held = sum(pool.slots[k].idle for k in index.eligible if k in exclude)
    if held and matching >= need.workers:
        parts.append(f"{held} that fit are held for jobs ahead in the queue")
    sizes = sorted(
        ((_available(g, pool, exclude), g) for g in index.groups),
        key=lambda item: (-item[0], item[1].path.relative_cost, item[1].sort_key),
    )
    best = [f"{n} on {g.path.value} path ({g.label})" for n, g in sizes[:3] if n]
    if need.workers > 1 and best:
        parts.append(f"{matching} idle match each need; largest groups: " + "; ".join(best))
    elif matching < need.workers:
        parts.append(f"{matching} idle match")
    return "; ".join(parts), ruled_out
