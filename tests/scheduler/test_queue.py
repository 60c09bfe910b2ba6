"""Queue policy: priority, then submission order; a waiting job is never starved."""

from __future__ import annotations

from typing import Any

from muster.scheduler import Placement, PoolIndex, QueuedJob, Unplaceable, schedule
from muster.spec import PathClass, parse_job
from tests.scheduler.workers import busy, gang, idle, worker


def queued(jid: str, seq: int, job: dict[str, Any]) -> QueuedJob:
    return QueuedJob(jid, parse_job(job), seq)


def outcomes(jobs: list[QueuedJob], pool: PoolIndex) -> dict[str, Placement | Unplaceable]:
    return {d.job_id: d.outcome for d in schedule(jobs, pool)}


def test_higher_priority_first_then_submission_order() -> None:
    pool = PoolIndex(idle(worker("a"), worker("b")))
    result = outcomes(
        [
            queued("early", 1, gang(2)),
            queued("late", 2, gang(2)),
            queued("urgent", 3, gang(2, priority=10)),
        ],
        pool,
    )
    assert isinstance(result["urgent"], Placement)
    assert isinstance(result["early"], Unplaceable)
    assert isinstance(result["late"], Unplaceable)
    pool = PoolIndex(idle(worker("a"), worker("b")))
    result = outcomes([queued("late", 2, gang(2)), queued("early", 1, gang(2))], pool)
    assert isinstance(result["early"], Placement)
    assert isinstance(result["late"], Unplaceable)


def test_placed_workers_leave_the_pool_within_a_pass() -> None:
    pool = PoolIndex(idle(*(worker(f"w{i}") for i in range(5))))
    result = outcomes(
        [queued("a", 1, gang(2)), queued("b", 2, gang(2)), queued("c", 3, gang(2))], pool
    )
    got = [o for o in result.values() if isinstance(o, Placement)]
    assert len(got) == 2
    assert not set(got[0].worker_ids) & set(got[1].worker_ids)
    assert isinstance(result["c"], Unplaceable)
    assert pool.idle_count == 1


def test_small_job_cannot_take_what_the_waiting_head_job_needs() -> None:
    # The head needs 3 GPU workers; 2 are idle and 1 is busy, so it waits.
    gpu = {"gpus": 2, "vendor": "nvidia"}
    views = [
        *idle(worker("g1", **gpu), worker("g2", **gpu), worker("cpu1", gpus=0)),
        busy(worker("g3", **gpu)),
    ]
    head = queued("big", 1, gang(3, 2, resources={"gpus": 2}))
    small = queued("small", 2, gang(1))
    result = outcomes([head, small], PoolIndex(views))
    assert isinstance(result["big"], Unplaceable)
    placed = result["small"]
    assert isinstance(placed, Placement)
    assert placed.worker_ids == ("cpu1",), "backfill only on a worker the head cannot use"
    # Without the CPU worker, the small job waits behind the head and says so.
    views = [*idle(worker("g1", **gpu), worker("g2", **gpu)), busy(worker("g3", **gpu))]
    result = outcomes([head, small], PoolIndex(views))
    waiting = result["small"]
    assert isinstance(waiting, Unplaceable)
    assert "waiting behind big" in waiting.reason


def test_a_job_too_big_for_the_pool_holds_nothing() -> None:
    pool = PoolIndex(idle(worker("a"), worker("b")))
    result = outcomes([queued("huge", 1, gang(5)), queued("small", 2, gang(2))], pool)
    assert isinstance(result["huge"], Unplaceable)
    assert isinstance(result["small"], Placement)


def test_head_job_is_placed_when_its_workers_free_up() -> None:
    gpu = {"gpus": 2, "vendor": "nvidia"}
    head = queued("big", 1, gang(3, 2, resources={"gpus": 2}))
    small = queued("small", 2, gang(1))
    views = idle(worker("g1", **gpu), worker("g2", **gpu), worker("g3", **gpu))
    result = outcomes([head, small], PoolIndex(views))
    assert isinstance(result["big"], Placement)
    assert isinstance(result["small"], Unplaceable)


def test_a_gang_only_a_path_not_set_up_can_carry_waits_and_says_so() -> None:
    """transport auto, workers in two regions with no shared private network: only a
    relayed (or direct) gang could form. With only the private path set up, the job stays
    queued naming the path, and holds back no later job that fits on a private network."""
    private_only = frozenset({PathClass.PRIVATE})
    apart = [  # GPU workers in two regions, no shared private network, no WireGuard
        worker("a", region="us-east-1", device=False, gpus=1, vendor="nvidia"),
        worker("b", region="eu-west-1", device=False, gpus=1, vendor="nvidia"),
    ]
    together = [worker(f"p{i}", private="vpc-1") for i in range(2)]
    far = {"network": "global", "transport": "auto", "backend": "nccl"}
    jobs = [
        queued("far", 1, gang(2, dist=far, resources={"gpus": 1})),
        queued("near", 2, gang(2)),
    ]
    got = outcomes(jobs, PoolIndex(idle(*apart, *together)))
    # With every path available the far job would take the relayed path...
    assert isinstance(got["far"], Placement)
    got = {
        d.job_id: d.outcome
        for d in schedule(jobs, PoolIndex(idle(*apart, *together)), private_only)
    }
    far, near = got["far"], got["near"]
    assert isinstance(near, Placement)
    assert near.path is PathClass.PRIVATE
    assert isinstance(far, Unplaceable)
    assert far.needs_path is not None
    assert f"only on the {far.needs_path.value} path" in far.reason
    assert "cannot set up yet" in far.reason


def test_a_job_kept_off_a_pair_holds_back_no_job_behind_it() -> None:
    """A job re-placed after its network failed between a and b cannot form its gang of
    two from {a, b}; the job behind it takes them instead of waiting behind it."""
    views = idle(worker("a"), worker("b"))
    first = QueuedJob(
        "retry",
        parse_job(gang(2)),
        1,
        apart={PathClass.DIRECT: frozenset({frozenset({"a", "b"})})},
    )
    got = outcomes([first, queued("next", 2, gang(2))], PoolIndex(views))
    assert isinstance(got["retry"], Unplaceable)
    assert "a and b not on the direct path" in got["retry"].reason
    assert isinstance(got["next"], Placement)


def _schedule_one_by_one(
    jobs: list[QueuedJob], pool: PoolIndex, paths: frozenset[PathClass]
) -> list[tuple[str, Placement | Unplaceable]]:
    """The queue rule asked job by job, every question put to place_gang afresh."""
    from muster.scheduler.place import GroupCache, Need, place_gang
    from muster.scheduler.queue import queue_order

    cache, held, waiting_for, out = GroupCache.of(pool), frozenset(), [], []
    for job in queue_order(jobs):
        outcome = place_gang(job.spec, pool, exclude=held, paths=paths, apart=job.apart)
        if isinstance(outcome, Placement):
            pool.take(outcome.worker_ids)
            if outcome.path is PathClass.PRIVATE and len(outcome.members) > 1:
                pool.hold_private(m.network.private_address for m in outcome.members)
            elif outcome.path is PathClass.RELAYED:
                pool.hold_relayed(m.advertise_address for m in outcome.members)
        else:
            free = place_gang(job.spec, pool, paths=paths, apart=job.apart)
            if held and isinstance(free, Placement):
                reason = (
                    "held back by queue order: the idle workers that fit are held for the "
                    f"job(s) ahead; waiting behind {waiting_for[0]}"
                )
                if len(waiting_for) > 1:
                    reason += f" and {len(waiting_for) - 1} more"
                outcome = Unplaceable(reason, outcome.ruled_out)
            eligible = cache.index(Need.of(job.spec)).eligible
            capacity = sum(pool.slots[k].idle + pool.slots[k].in_use for k in eligible)
            if (
                capacity >= job.spec.gang.num_workers
                and outcome.needs_path is None
                and not job.apart
            ):
                held = held | frozenset(eligible)
                waiting_for.append(job.id)
        out.append((job.id, outcome))
    return out


def test_a_long_queue_of_few_shapes_is_decided_as_if_each_job_were_asked_afresh() -> None:
    """schedule() asks place_gang once per job shape until a placement changes the pool;
    its decisions are those of asking every job afresh, on mixed pools and queues."""
    import random

    for seed in range(40):
        rnd = random.Random(seed)
        workers = [
            worker(
                f"w{i}",
                gpus=rnd.choice([0, 0, 2, 8]),
                vendor="nvidia",
                torch=rnd.choice(["2.5.1", "2.5.1", "2.4.0"]),
                private=rnd.choice([None, "net-a", "net-b"]),
                region=rnd.choice(["us-east-1", "us-west-2"]),
            )
            for i in range(rnd.randint(3, 30))
        ]
        views = [idle(w)[0] if rnd.random() < 0.8 else busy(w) for w in workers]
        jobs = []
        for i in range(rnd.randint(1, 80)):
            spec = gang(rnd.randint(1, 6), priority=rnd.choice([0, 0, 1]))
            if rnd.random() < 0.3:
                spec["resources"] = {"gpus": rnd.choice([1, 2, 4])}
                spec["distributed"]["backend"] = "nccl"
            if rnd.random() < 0.3:
                spec["distributed"]["transport"] = "direct"
            apart = None
            if rnd.random() < 0.05 and len(workers) > 1:
                pair = frozenset({workers[0].id, workers[1].id})
                apart = {PathClass.PRIVATE: frozenset({pair})}
            jobs.append(QueuedJob(f"j{i}", parse_job(spec), i, apart=apart))
        paths = frozenset(rnd.sample(list(PathClass), rnd.randint(1, len(PathClass))))
        got = [(d.job_id, d.outcome) for d in schedule(jobs, PoolIndex(views), paths)]
        assert got == _schedule_one_by_one(jobs, PoolIndex(views), paths), seed
