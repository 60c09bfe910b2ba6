"""Gang placement: table-driven cases and properties checked against the linear scan."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from muster.scheduler import Placement, PoolIndex, Unplaceable, WorkerKind, kind_problem, place_gang
from muster.scheduler.linear import linear_place
from muster.scheduler.place import Need
from muster.scheduler.queue import QueuedJob, schedule
from muster.spec import PathClass, WorkerState, WorkerView, parse_job
from tests.scheduler.workers import busy, gang, idle, worker


def place(job: dict[str, Any], views: list[WorkerView]) -> Placement | Unplaceable:
    return place_gang(parse_job(job), views)


def placed(job: dict[str, Any], views: list[WorkerView]) -> Placement:
    outcome = place(job, views)
    assert isinstance(outcome, Placement), outcome
    return outcome


def unplaceable(job: dict[str, Any], views: list[WorkerView]) -> str:
    outcome = place(job, views)
    assert isinstance(outcome, Unplaceable), outcome
    return outcome.reason


def test_whole_gang_of_distinct_idle_workers() -> None:
    result = placed(gang(2), idle(worker("c"), worker("a"), worker("b")))
    assert result.worker_ids == ("a", "b")
    assert result.path is PathClass.DIRECT


def test_busy_and_offline_workers_are_not_used() -> None:
    views = [
        busy(worker("a")),
        *idle(worker("b")),
        WorkerView(inventory=worker("c"), state=WorkerState.OFFLINE),
    ]
    reason = unplaceable(gang(2), views)
    assert "1 of 3 workers idle (1 busy, 1 offline)" in reason
    assert placed(gang(1), views).worker_ids == ("b",)


def test_never_a_partial_gang_and_reason_counts_torch_versions() -> None:
    views = idle(
        worker("a", torch="2.5.1"),
        worker("b", torch="2.4.0"),
        worker("c", torch="2.4.0"),
        worker("d", torch="2.4.0", backends=("nccl",)),
    )
    reason = unplaceable(gang(3), views)
    assert "needs 3 idle workers with one torch version, torchrun, gloo" in reason
    assert "1 lack gloo" in reason
    assert "3 idle match" in reason
    assert "2 on direct path (torch 2.4.0" in reason
    assert "1 on direct path (torch 2.5.1" in reason


def test_reason_names_ruled_out_workers() -> None:
    views = idle(
        worker("a", backends=("gloo",), gpus=8, vendor="nvidia"),
        worker("b", gpus=1, vendor="nvidia"),
        worker("c", torch=None),
        worker("d", gpus=8, vendor="nvidia", address=False),
        worker("e", gpus=8, vendor="nvidia"),
    )
    reason = unplaceable(gang(2, 4, resources={"gpus": 4}), views)
    for part in (
        "1 lack nccl",
        "1 have fewer than 4 GPUs",
        "1 lack torch",
        "1 have no advertise address",
        "1 idle match",
    ):
        assert part in reason, reason


def test_no_workers_at_all() -> None:
    assert "no workers have joined" in unplaceable(gang(2), [])


def test_one_torch_version_per_gang() -> None:
    views = idle(worker("a", torch="2.4.0"), worker("b", torch="2.5.1"), worker("c", torch="2.5.1"))
    assert placed(gang(2), views).worker_ids == ("b", "c")


def test_one_vendor_under_nccl_but_not_under_gloo() -> None:
    views = idle(worker("a", gpus=1, vendor="nvidia"), worker("b", gpus=1, vendor="amd"))
    assert "largest groups" in unplaceable(gang(2, resources={"gpus": 1}), views)
    mixed = placed(gang(2, resources={"gpus": 1}, dist={"backend": "gloo"}), views)
    assert mixed.worker_ids == ("a", "b")


def test_gpus_must_cover_procs() -> None:
    views = idle(
        worker("a", gpus=2, vendor="nvidia"),
        worker("b", gpus=4, vendor="nvidia"),
        worker("c", gpus=8, vendor="nvidia"),
    )
    assert placed(gang(2, 4, resources={"gpus": 4}), views).worker_ids == ("b", "c")


def test_tightest_gpu_fit_first() -> None:
    views = idle(
        worker("a", gpus=8, vendor="nvidia"),
        worker("b", gpus=2, vendor="nvidia"),
        worker("c", gpus=2, vendor="nvidia"),
        worker("d", gpus=4, vendor="nvidia"),
    )
    assert placed(gang(2, 2, resources={"gpus": 2}), views).worker_ids == ("b", "c")


@pytest.mark.parametrize(
    ("network", "expected"),
    [
        ("colocated", None),
        ("regional", ("a", "b")),
        ("global", 2),
    ],
)
def test_network_class(network: str, expected: tuple[str, ...] | int | None) -> None:
    views = idle(
        worker("a", provider="aws", region="us-east-1", region_class="us"),
        worker("b", provider="gcp", region="us-central1", region_class="us"),
        worker("c", provider="gcp", region="europe-west4", region_class="eu"),
    )
    outcome = place(gang(2, dist={"network": network}), views)
    if expected is None:
        assert isinstance(outcome, Unplaceable)
    elif isinstance(expected, int):
        assert isinstance(outcome, Placement)
        assert len(outcome.worker_ids) == expected
    else:
        assert isinstance(outcome, Placement)
        assert outcome.worker_ids == expected


def test_global_spans_region_classes() -> None:
    views = idle(worker("a", region_class="us"), worker("c", region_class="eu"))
    assert isinstance(place(gang(2), views), Unplaceable)
    assert placed(gang(2, dist={"network": "global"}), views).worker_ids == ("a", "c")


def test_private_path_preferred_when_one_region_shares_a_network() -> None:
    views = idle(
        worker("a"), worker("b"), worker("p1", private="vpc-1"), worker("p2", private="vpc-1")
    )
    result = placed(gang(2), views)
    assert (result.path, result.worker_ids) == (PathClass.PRIVATE, ("p1", "p2"))


def test_private_needs_one_network_in_one_region() -> None:
    views = idle(
        worker("p1", private="vpc-1", device=False), worker("p2", private="vpc-2", device=False)
    )
    assert isinstance(place(gang(2), views), Unplaceable)


def test_container_only_needs_transport_auto_and_goes_relayed() -> None:
    views = idle(worker("a"), worker("k", device=False, container=True))
    reason = unplaceable(gang(2), views)
    assert "container-only" in reason
    assert "transport: auto" in reason
    result = placed(gang(2, dist={"transport": "auto"}), views)
    assert (result.path, result.worker_ids) == (PathClass.RELAYED, ("a", "k"))


def test_relayed_counts_four_times_slower_than_direct() -> None:
    assert PathClass.RELAYED.relative_cost == 4 * PathClass.DIRECT.relative_cost
    views = idle(
        worker("k1", device=False, container=True),
        worker("k2", device=False, container=True),
        worker("x", region_class="eu"),
        worker("y", region_class="eu"),
    )
    result = placed(gang(2, dist={"transport": "auto"}), views)
    assert (result.path, result.worker_ids) == (PathClass.DIRECT, ("x", "y"))


def test_a_private_pair_kept_apart_is_placed_direct_instead() -> None:
    """The probe could not cross p1-p2's private network: the next epoch takes the
    direct path between the same two workers."""
    views = idle(worker("p1", private="vpc-1"), worker("p2", private="vpc-1"))
    apart = {PathClass.PRIVATE: frozenset({frozenset({"p1", "p2"})})}
    result = place_gang(parse_job(gang(2)), views, apart=apart)
    assert isinstance(result, Placement)
    assert (result.path, result.worker_ids) == (PathClass.DIRECT, ("p1", "p2"))


def test_a_direct_pair_kept_apart_is_split_or_waits_naming_it() -> None:
    views = idle(worker("a"), worker("b"), worker("c"))
    apart = {PathClass.DIRECT: frozenset({frozenset({"a", "b"})})}
    result = place_gang(parse_job(gang(2)), views, apart=apart)
    assert isinstance(result, Placement)
    assert result.worker_ids == ("a", "c")
    three = place_gang(parse_job(gang(3)), views, apart=apart)
    assert isinstance(three, Unplaceable)
    assert "kept apart after an epoch whose network failed: a and b not on the direct path" in (
        three.reason
    )
    # Under transport auto the relayed path may still take the pair.
    auto = place_gang(parse_job(gang(3, dist={"transport": "auto"})), views, apart=apart)
    assert isinstance(auto, Placement)
    assert auto.path is PathClass.RELAYED


def test_a_worker_in_several_failed_pairs_is_left_out_not_its_peers() -> None:
    """a failed with b and with c (a probe that timed out keeps its member apart from
    everyone): the gang of three is b, c and d, not given up on."""
    views = idle(worker("a"), worker("b"), worker("c"), worker("d"))
    apart = {PathClass.DIRECT: frozenset({frozenset({"a", "b"}), frozenset({"a", "c"})})}
    result = place_gang(parse_job(gang(3)), views, apart=apart)
    assert isinstance(result, Placement)
    assert result.worker_ids == ("b", "c", "d")
    # Only when no three are pairwise apart does the job wait.
    apart = {PathClass.DIRECT: frozenset({frozenset({"b", "c"}), frozenset({"a", "d"})})}
    assert isinstance(place_gang(parse_job(gang(3)), views, apart=apart), Unplaceable)


def test_single_worker_job_needs_no_address_or_network() -> None:
    result = placed(
        {"name": "one", "entrypoint": "t.py"},
        idle(worker("a", address=False, device=False, container=True)),
    )
    assert (result.path, result.worker_ids) == (PathClass.PRIVATE, ("a",))


def test_decision_does_not_change_the_pool() -> None:
    pool = PoolIndex(idle(worker("a"), worker("b")))
    first = place_gang(parse_job(gang(2)), pool)
    assert place_gang(parse_job(gang(2)), pool) == first
    assert pool.idle_count == 2


def test_take_and_give_back_keep_counts_current() -> None:
    pool = PoolIndex(idle(*(worker(f"w{i}") for i in range(4))))
    spec = parse_job(gang(3))
    result = place_gang(spec, pool)
    assert isinstance(result, Placement)
    pool.take(result.worker_ids)
    assert isinstance(place_gang(spec, pool), Unplaceable)
    pool.give_back(result.worker_ids)
    assert place_gang(spec, pool) == result


# ---- properties ------------------------------------------------------------------------

TORCH = ["2.4.0", "2.5.1", "2.5.1", "2.5.1", None]
PROVIDERS = [("aws", "us-east-1", "us"), ("gcp", "us-central1", "us"), ("gcp", "eu-west4", "eu")]


@st.composite
def pools(draw: st.DrawFn) -> list[WorkerView]:
    count = draw(st.integers(0, 16))
    views = []
    for i in range(count):
        provider, region, region_class = draw(st.sampled_from(PROVIDERS))
        gpus = draw(st.sampled_from([0, 1, 2, 4, 8]))
        inv = worker(
            f"w{i:02d}",
            torch=draw(st.sampled_from(TORCH)),
            torchrun=draw(st.integers(0, 9).map(bool)),
            backends=draw(st.sampled_from([("gloo",), ("nccl",)] + [("gloo", "nccl")] * 4)),
            gpus=gpus,
            vendor=draw(st.sampled_from(["nvidia", "nvidia", "amd"])),
            provider=provider,
            region=region,
            region_class=region_class,
            private=draw(st.sampled_from([None, f"vpc-{provider}", "vpc-x"])),
            device=draw(st.integers(0, 3).map(bool)),
            container=draw(st.integers(0, 3).map(lambda x: x == 0)),
            address=draw(st.integers(0, 9).map(bool)),
        )
        state = draw(
            st.sampled_from([WorkerState.IDLE] * 4 + [WorkerState.BUSY, WorkerState.OFFLINE])
        )
        views.append(WorkerView(inventory=inv, state=state))
    return views


@st.composite
def jobs(draw: st.DrawFn) -> dict[str, Any]:
    gpus = draw(st.sampled_from([0, 0, 0, 1, 2, 4]))
    procs = draw(st.integers(1, max(gpus, 1)))
    dist = {
        "num_workers": draw(st.sampled_from([1, 2, 2, 3, 4])),
        "procs_per_worker": procs,
        "network": draw(st.sampled_from(["colocated", "regional", "global"])),
        "transport": draw(st.sampled_from(["direct", "auto"])),
    }
    if gpus == 0:
        dist["backend"] = "gloo"
    else:
        dist["backend"] = draw(st.sampled_from(["gloo", "nccl"]))
    return {"name": "prop", "entrypoint": "t.py", "resources": {"gpus": gpus}, "distributed": dist}


def check_placement(job: dict[str, Any], views: list[WorkerView], result: Placement) -> None:
    spec = parse_job(job)
    need = Need.of(spec)
    members = result.members
    state = {v.id: v.state for v in views}
    assert len(members) == need.workers, "never a partial gang"
    assert len(set(result.worker_ids)) == need.workers, "no worker used twice"
    assert all(state[m.id] is WorkerState.IDLE for m in members)
    assert all(kind_problem(WorkerKind.of(m), need) is None for m in members)
    assert len({m.torch_version for m in members}) == 1, "no mixed torch versions"
    if need.backend == "nccl":
        assert len({m.gpus.vendor for m in members}) == 1, "no mixed vendors under nccl"
    if need.workers > 1:
        if need.network == "colocated":
            assert len({(m.provider, m.region) for m in members}) == 1
        elif need.network == "regional":
            assert len({m.region_class for m in members}) == 1
        if result.path is PathClass.PRIVATE:
            assert len({(m.provider, m.region, m.network.private_network_id) for m in members}) == 1
            assert members[0].network.private_network_id is not None
        elif result.path is PathClass.DIRECT:
            assert all(m.network.can_create_device for m in members)
        else:
            assert need.transport == "auto"
            addresses = [m.advertise_address for m in members]
            assert len(set(addresses)) == len(addresses), "relayed: one member per address"


@settings(
    max_examples=int(os.environ.get("MUSTER_HYPOTHESIS_EXAMPLES", "400")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(pools(), jobs(), st.randoms(use_true_random=False))
def test_placement_properties(
    views: list[WorkerView], job: dict[str, Any], rnd: random.Random
) -> None:
    outcome = place(job, views)
    reference = linear_place(parse_job(job), views)
    event(f"{type(outcome).__name__} {getattr(outcome, 'path', '')}")
    if isinstance(outcome, Placement):
        check_placement(job, views, outcome)
        assert reference == outcome, "indexed and linear scan agree"
    else:
        assert reference is None, f"linear scan found {reference} but place_gang said {outcome}"
        assert outcome.reason
    shuffled = list(views)
    rnd.shuffle(shuffled)
    assert place(job, shuffled) == outcome, "deterministic whatever the snapshot order"


def _at(wid: str, address: str, *, device: bool = True) -> Any:
    w = worker(wid, private="vpc-1", device=device)
    return w.model_copy(
        update={"network": w.network.model_copy(update={"private_address": address})}
    )


def test_a_private_address_serves_one_gang_the_next_goes_elsewhere_or_waits() -> None:
    """Two agents on one host share its private address: the gang rules tell members by
    address, so a host running a private gang takes no second one on the private path
    (IPCollision). The next gang takes other hosts, the direct path, or waits saying why."""
    views = idle(_at("a2", "10.0.0.1"), _at("b2", "10.0.0.2"), _at("c1", "10.0.0.3"))
    pool = PoolIndex(views)
    assert placed(gang(2), views).worker_ids == ("a2", "b2")  # nothing held: the first two
    pool.hold_private(["10.0.0.1", "10.0.0.2"])  # a gang runs on a1 and b1
    result = place_gang(parse_job(gang(2)), pool)
    assert isinstance(result, Placement)
    assert result.path is PathClass.DIRECT  # not private: only c1 is free there
    # Nothing but the private path allowed: it waits, and says so.
    private_only = PoolIndex(
        idle(_at("a2", "10.0.0.1", device=False), _at("c1", "10.0.0.3", device=False))
    )
    private_only.hold_private(["10.0.0.1", "127.0.0.1"])  # loopback is never held
    assert private_only.private_taken == {"10.0.0.1"}
    waits = place_gang(parse_job(gang(2)), private_only)
    assert isinstance(waits, Unplaceable)
    assert "IPCollision: 1 idle worker(s)" in waits.reason


def test_a_private_gang_placed_in_a_pass_holds_its_addresses_for_the_rest_of_it() -> None:
    views = idle(
        _at("a1", "10.0.0.1"), _at("b1", "10.0.0.2"), _at("a2", "10.0.0.1"), _at("c1", "10.0.0.3")
    )
    first = QueuedJob("j1", parse_job(gang(2)), 1)
    second = QueuedJob("j2", parse_job(gang(2)), 2)
    decisions = schedule([first, second], PoolIndex(views))
    one, two = (d.outcome for d in decisions)
    assert isinstance(one, Placement)
    assert isinstance(two, Placement)
    assert (one.path, one.worker_ids) == (PathClass.PRIVATE, ("a1", "a2"))
    assert (two.path, two.worker_ids) == (PathClass.PRIVATE, ("b1", "c1"))
    views = idle(_at("a1", "10.0.0.1"), _at("b1", "10.0.0.2"), _at("a2", "10.0.0.1"),
                 _at("b2", "10.0.0.2"))  # fmt: skip
    three = QueuedJob("j3", parse_job(gang(3)), 3)
    four = QueuedJob("j4", parse_job(gang(1)), 4)
    decisions = schedule([three, four], PoolIndex(views))
    big, small = (d.outcome for d in decisions)
    assert isinstance(big, Placement)
    assert big.path is PathClass.PRIVATE
    assert isinstance(small, Placement)  # a gang of one needs no network: never held


def _relayed_at(wid: str, address: str) -> Any:
    """A container-only worker (no device, no private network) at ``address``."""
    return worker(wid, device=False, container=True).model_copy(
        update={"advertise_address": address}
    )


def test_a_relayed_gang_takes_one_member_per_address_and_none_a_running_one_routes() -> None:
    """Relayed members are reached at their own addresses: two agents behind one address
    are never in one relayed gang, and a running relayed gang's addresses take no second
    one (IPCollision); a gang placed in a pass holds its addresses for the rest of it."""
    auto = gang(2, dist={"transport": "auto"})
    views = idle(
        _relayed_at("a1", "198.51.100.1"),
        _relayed_at("a2", "198.51.100.1"),
        _relayed_at("b1", "198.51.100.2"),
    )
    first = placed(auto, views)
    assert first.path is PathClass.RELAYED
    assert first.worker_ids == ("a1", "b1"), "a1 and a2 share one address"
    pool = PoolIndex(views)
    pool.hold_relayed(["198.51.100.2"])  # a relayed gang runs at b's address
    waits = place_gang(parse_job(auto), pool)
    assert isinstance(waits, Unplaceable)
    assert "IPCollision: the relayed path's idle workers are at addresses" in waits.reason
    decisions = schedule(
        [QueuedJob("j1", parse_job(auto), 1), QueuedJob("j2", parse_job(auto), 2)],
        PoolIndex(views + idle(_relayed_at("c1", "198.51.100.3"))),
    )
    one, two = (d.outcome for d in decisions)
    assert isinstance(one, Placement)
    assert isinstance(two, Unplaceable), "a2 and c1 remain, but a2's address is j1's"
