"""Pure gang scheduling: placement and path-class choice over a snapshot, and queue policy."""

from muster.scheduler.place import (
    IP_COLLISION,
    Apart,
    Need,
    Placement,
    Unplaceable,
    kind_problem,
    place_gang,
)
from muster.scheduler.pool import PoolIndex, WorkerKind
from muster.scheduler.queue import Decision, QueuedJob, queue_order, schedule

__all__ = [
    "IP_COLLISION",
    "Apart",
    "Decision",
    "Need",
    "Placement",
    "PoolIndex",
    "QueuedJob",
    "Unplaceable",
    "WorkerKind",
    "kind_problem",
    "place_gang",
    "queue_order",
    "schedule",
]
