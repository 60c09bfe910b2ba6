"""The direct path's network handshake in the gang lifecycle: keys, peers, then the rendezvous."""

from __future__ import annotations

from muster.gang import (
    GangRun,
    NetReady,
    NetUp,
    Placed,
    RecordEvent,
    ReleaseWorker,
    SendNetPeers,
    SendNetSetup,
    SendPrepareRendezvous,
    SendStop,
    SetJobState,
    SetMemberState,
    Tick,
    step,
)
from muster.gang.lifecycle import RENDEZVOUS_TIMEOUT_S
from muster.spec import JobState, MemberState, PathClass

J, M = JobState, MemberState
W = ("w0", "w1", "w2")
PLACED = Placed("job1", 1, W, PathClass.DIRECT, master_addr="100.64.0.1")
KEYS = tuple(NetReady(n, f"key{n}=", f"10.0.0.{n + 1}:5182{n}") for n in range(3))


def placed() -> GangRun:
    run, actions = step(GangRun(), PLACED, 0)
    assert actions == (
        SetJobState(J.NETWORKING, "epoch 1: setting up the direct network between 3 members"),
        *(SendNetSetup(n, W[n]) for n in range(3)),
    )
    return run


def test_keys_go_round_once_all_are_in_and_the_rendezvous_waits_for_every_device() -> None:
    run = placed()
    run, actions = step(run, KEYS[0], 1)
    assert actions == ()
    run, actions = step(run, KEYS[2], 1)
    assert actions == ()
    run, actions = step(run, KEYS[1], 1)
    assert actions == (
        SendNetPeers(0, "w0", ((1, "key1=", "10.0.0.2:51821"), (2, "key2=", "10.0.0.3:51822"))),
        SendNetPeers(1, "w1", ((0, "key0=", "10.0.0.1:51820"), (2, "key2=", "10.0.0.3:51822"))),
        SendNetPeers(2, "w2", ((0, "key0=", "10.0.0.1:51820"), (1, "key1=", "10.0.0.2:51821"))),
    )
    run, _ = step(run, KEYS[1], 1)  # a repeated NET_READY changes nothing
    for node in (0, 1):
        run, actions = step(run, NetUp(node), 2)
        assert actions == ()
    assert run.job_state is J.NETWORKING
    run, actions = step(run, NetUp(2), 2)
    assert actions == (
        RecordEvent(
            "NetworkReady",
            "epoch 1: direct network up between 3 members",
            {"epoch": 1, "path": "direct"},
        ),
        SetJobState(J.RENDEZVOUS, "epoch 1: waiting for node0 to publish its address"),
        SendPrepareRendezvous("w0", "100.64.0.1", None),
    )


def test_a_member_that_cannot_make_its_device_fails_the_job_and_every_device_comes_down() -> None:
    run = placed()
    run, _ = step(run, KEYS[0], 1)
    run, actions = step(run, NetReady(1, error="no CAP_NET_ADMIN"), 1)
    cause = "node1 (worker w1) could not set up the direct path: no CAP_NET_ADMIN"
    assert actions[0] == SetJobState(J.FAILED, cause)
    for node, worker in enumerate(W):
        assert SetMemberState(node, M.CANCELLED) in actions
        assert ReleaseWorker(worker) in actions
        assert SendStop(worker, cause) in actions  # the agent removes the device
    assert run.settled


def test_a_network_that_never_comes_up_fails_at_the_deadline_naming_the_late_members() -> None:
    run = placed()
    run, _ = step(run, KEYS[0], 1)
    run, _ = step(run, KEYS[1], 1)
    run, actions = step(run, Tick(), RENDEZVOUS_TIMEOUT_S - 1)
    assert actions == ()
    run, actions = step(run, Tick(), RENDEZVOUS_TIMEOUT_S + 1)
    assert actions[0] == SetJobState(
        J.FAILED,
        "the direct network was not up within 120s: node0 (worker w0) did not set its peers, "
        "node1 (worker w1) did not set its peers, node2 (worker w2) had no key",
    )


def test_a_gang_of_one_and_the_private_path_need_no_network() -> None:
    _, actions = step(GangRun(), Placed("job1", 1, ("w0",), PathClass.DIRECT), 0)
    assert isinstance(actions[-1], SendPrepareRendezvous)
    _, actions = step(GangRun(), Placed("job1", 1, W, PathClass.PRIVATE), 0)
    assert not any(isinstance(a, SendNetSetup) for a in actions)


def test_frames_of_the_network_phase_are_ignored_after_it() -> None:
    run = placed()
    for key in KEYS:
        run, _ = step(run, key, 1)
    for node in range(3):
        run, _ = step(run, NetUp(node), 1)
    assert run.job_state is J.RENDEZVOUS
    assert step(run, NetReady(0, error="late"), 2)[1] == ()
    assert step(run, NetUp(1), 2)[1] == ()


def test_a_member_whose_peers_cannot_be_set_fails_the_job_with_its_reason() -> None:
    run = placed()
    for key in KEYS:
        run, _ = step(run, key, 1)
    run, actions = step(run, NetReady(2, error="no WireGuard handshake within 30s with x"), 2)
    assert actions[0] == SetJobState(
        J.FAILED,
        "node2 (worker w2) could not set up the direct path: "
        "no WireGuard handshake within 30s with x",
    )


def test_the_rendezvous_gets_its_whole_time_after_a_slow_network() -> None:
    run = placed()
    for key in KEYS:
        run, _ = step(run, key, 100)
    for node in range(3):
        run, _ = step(run, NetUp(node), 110)
    run, actions = step(run, Tick(), 110 + RENDEZVOUS_TIMEOUT_S - 1)
    assert actions == ()
    run, actions = step(run, Tick(), 110 + RENDEZVOUS_TIMEOUT_S + 1)
    first = actions[0]
    assert isinstance(first, SetJobState)
    assert first.state is J.FAILED
    assert "did not publish its rendezvous address within 120s" in first.reason


def test_a_repeated_net_up_does_not_start_anything_again() -> None:
    run = GangRun()
    run, _ = step(run, Placed("job1", 1, W[:2], PathClass.DIRECT, probe_seconds=1.0), 0)
    for key in KEYS[:2]:
        run, _ = step(run, key, 1)
    run, _ = step(run, NetUp(0), 2)
    run, actions = step(run, NetUp(1), 2)
    assert any(a.__class__.__name__ == "SendProbeListen" for a in actions)
    deadline = run.rendezvous_deadline
    run, actions = step(run, NetUp(1), 50)
    assert actions == ()
    assert run.rendezvous_deadline == deadline
