"""The queue policy: which waiting job gets workers first, and how none starves.

Rule:
  1. Jobs are considered by priority (higher first), then by submission order.
  2. A job that fits is placed at once, and its workers leave the pool for this pass.
  3. A job that does not fit holds every idle worker it could use (every worker of a
     kind that passes its per-worker needs). A job behind it may only take workers that
     no job ahead of it is holding. Small jobs therefore backfill around a large waiting
     job, but never on the machines it is waiting to gather, so it cannot starve.
  4. Except: a job that could not fit even if every reserved and busy worker were free
     (the pool is too small for it) holds nothing; it waits, with that reason, for more
     workers to join, and the jobs behind it run.

``schedule`` is pure with respect to the snapshot it is given: it consumes a PoolIndex
built for this pass (taking the placed workers out of it) and returns the decisions; the
caller applies them in the store, one transaction per placement.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from muster.scheduler.place import (
    ALL_PATHS,
    Apart,
    GroupCache,
    Need,
    Placement,
    Unplaceable,
    place_gang,
)
from muster.scheduler.pool import PoolIndex, WorkerKind
from muster.spec.job import JobSpec
from muster.spec.network import PathClass


@dataclass(frozen=True)
class QueuedJob:
    id: str
    spec: JobSpec
    seq: int  # submission order
    apart: Apart | None = None  # pairs its gang must not hold together (a failed epoch)


@dataclass(frozen=True)
class Decision:
    job_id: str
    outcome: Placement | Unplaceable


def queue_order(jobs: Sequence[QueuedJob]) -> list[QueuedJob]:
    """Higher priority first, then earlier submission."""
    return sorted(jobs, key=lambda j: (-j.spec.priority, j.seq))


def schedule(
    jobs: Sequence[QueuedJob], pool: PoolIndex, paths: frozenset[PathClass] = ALL_PATHS
) -> list[Decision]:
    """One scheduler pass over the waiting jobs; see the module docstring for the rule.
    ``paths``: the path classes the controller can set up (see place_gang)."""
    cache = GroupCache.of(pool)
    held: frozenset[WorkerKind] = frozenset()
    waiting_for: list[str] = []
    decisions: list[Decision] = []
    # Jobs of one Need ask the same question of the same pool until a placement changes it
    # (pool.version): a queue of 1,000 jobs of a few shapes asks a few dozen, not 2,000.
    asked: dict[tuple[Need, frozenset[WorkerKind], int], Placement | Unplaceable] = {}
    capacity_of: dict[Need, tuple[int, frozenset[WorkerKind]]] = {}

    def ask(job: QueuedJob, need: Need, exclude: frozenset[WorkerKind]) -> Placement | Unplaceable:
        if job.apart:
            return place_gang(job.spec, pool, exclude=exclude, paths=paths, apart=job.apart)
        key = (need, exclude, pool.version)
        found = asked.get(key)
        if found is None:
            found = asked[key] = place_gang(job.spec, pool, exclude=exclude, paths=paths)
        return found

    for job in queue_order(jobs):
        need = Need.of(job.spec)
        outcome = ask(job, need, held)
        if isinstance(outcome, Placement):
            pool.take(outcome.worker_ids)
            if outcome.path is PathClass.PRIVATE and len(outcome.members) > 1:
                pool.hold_private(m.network.private_address for m in outcome.members)
            elif outcome.path is PathClass.RELAYED:
                pool.hold_relayed(m.advertise_address for m in outcome.members)
        else:
            free = ask(job, need, frozenset())
            if held and isinstance(free, Placement):
                # The first clause (before ";") is the kind of reason and stays the same
                # while the job waits its turn; which jobs are ahead changes every pass.
                reason = (
                    "held back by queue order: the idle workers that fit are held for the "
                    f"job(s) ahead; waiting behind {waiting_for[0]}"
                )
                if len(waiting_for) > 1:
                    reason += f" and {len(waiting_for) - 1} more"
                outcome = Unplaceable(
                    reason,
                    outcome.ruled_out,
                )
            if need not in capacity_of:  # idle + in use per kind: takes do not change it
                eligible = frozenset(cache.index(need).eligible)
                capacity_of[need] = (
                    sum(pool.slots[k].idle + pool.slots[k].in_use for k in eligible),
                    eligible,
                )
            capacity, eligible = capacity_of[need]
            # A job that waits for a path the controller cannot set up holds nothing back,
            # nor one kept off pairs of workers (it may wait for others to join for long).
            if (
                capacity >= job.spec.gang.num_workers
                and outcome.needs_path is None
                and not job.apart
            ):
                held = held | eligible
                waiting_for.append(job.id)
        decisions.append(Decision(job.id, outcome))
    return decisions
