"""The direct path's network handshake in the gang lifecycle: keys, peers, then the rendezvous."""

from __future__ import annotations

from muster.gang import (
    Cancel,
    ControllerRestarted,
    GangRun,
    KeepApart,
    LinkBack,
    MasterChecked,
    MemberExited,
    MemberSnapshot,
    MemberStarted,
    NetPath,
    NetReady,
    NetUp,
    Placed,
    PortPublished,
    RecordEvent,
    ReleaseWorker,
    SendNetPeers,
    SendNetSetup,
    SendPrepareRendezvous,
    SendStop,
    SetCondition,
    SetJobState,
    SetMemberState,
    Tick,
    step,
)
from muster.gang.turn import MAX_NETWORK_EPOCHS, RENDEZVOUS_TIMEOUT_S
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
        SetCondition("GangReady", True, "NetworkReady", "epoch 1: 3 members on the direct path"),
        SetJobState(J.RENDEZVOUS, "epoch 1: waiting for node0 to publish its address"),
        SendPrepareRendezvous("w0", "100.64.0.1", None),
    )


def test_the_network_ready_event_gives_each_members_mtu() -> None:
    """Each agent sizes its device (the gang's MTU, less what its uplink lacks): the event
    says what each took, node by node, and leaves out what an older agent did not say."""
    run = placed()
    for node, mtu in enumerate((1420, None, 1380)):
        ready = KEYS[node]
        run, _ = step(run, NetReady(ready.node, ready.public_key, ready.endpoint, mtu=mtu), 1)
    for node in range(3):
        run, actions = step(run, NetUp(node), 2)
    assert actions[0] == RecordEvent(
        "NetworkReady",
        "epoch 1: direct network up between 3 members (MTU 1420, ?, 1380)",
        {"epoch": 1, "path": "direct", "mtu": [1420, None, 1380]},
    )


def test_a_member_that_cannot_make_its_device_fences_the_epoch_and_every_device_comes_down() -> (
    None
):
    """Nothing of the user's ran: the epoch is fenced, its workers go back, and the job is
    queued again with that member kept apart from the others on the direct path."""
    run = placed()
    run, _ = step(run, KEYS[0], 1)
    run, actions = step(run, NetReady(1, error="no CAP_NET_ADMIN"), 1)
    cause = "node1 (worker w1) could not set up the direct path: no CAP_NET_ADMIN"
    again = (
        f"epoch 1 fenced: {cause}; placing the gang again, keeping w0 and w1, w1 and w2 "
        "apart on the direct path"
    )
    assert actions[0] == SetCondition("NetworkQualified", False, "DirectPathFailed", cause)
    assert KeepApart(PathClass.DIRECT, (("w0", "w1"), ("w1", "w2"))) in actions
    assert SetCondition("GangReady", False, "DirectPathFailed", again) in actions
    assert actions[-1] == SetJobState(J.QUEUED, again)
    for node, worker in enumerate(W):
        assert SetMemberState(node, M.CANCELLED) in actions
        assert ReleaseWorker(worker) in actions
        assert SendStop(worker, cause) in actions  # the agent removes the device
    assert run.settled
    assert run.fenced
    # The fenced epoch ignores what its members still say, and a cancel changes nothing.
    assert step(run, NetUp(0), 2)[1] == ()
    assert step(run, Cancel("cancelled by the user"), 2)[1] == ()


def test_in_the_last_network_epoch_a_failure_fails_the_job() -> None:
    run, _ = step(
        GangRun(), PLACED.__class__(**{**PLACED.__dict__, "epoch": MAX_NETWORK_EPOCHS}), 0
    )
    run, actions = step(run, NetReady(1, error="no CAP_NET_ADMIN"), 1)
    cause = "node1 (worker w1) could not set up the direct path: no CAP_NET_ADMIN"
    assert SetJobState(J.FAILED, f"{cause} (epoch {MAX_NETWORK_EPOCHS}; not placed again)") in (
        actions
    )
    assert not any(isinstance(a, KeepApart) for a in actions)
    assert run.settled
    assert not run.fenced


def test_a_network_that_never_comes_up_is_fenced_at_the_deadline_naming_the_late_members() -> None:
    run = placed()
    run, _ = step(run, KEYS[0], 1)
    run, _ = step(run, KEYS[1], 1)
    run, actions = step(run, Tick(), RENDEZVOUS_TIMEOUT_S - 1)
    assert actions == ()
    run, actions = step(run, Tick(), RENDEZVOUS_TIMEOUT_S + 1)
    state = actions[-1]
    assert isinstance(state, SetJobState)
    assert state.state is J.QUEUED
    assert state.reason.startswith(
        "epoch 1 fenced: the direct network was not up within 120s: node0 (worker w0) did not "
        "set its peers, node1 (worker w1) did not set its peers, node2 (worker w2) had no key"
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


def test_a_member_with_silent_peers_keeps_only_those_pairs_apart() -> None:
    run = placed()
    for key in KEYS:
        run, _ = step(run, key, 1)
    why = "no WireGuard handshake within 30s with x"
    run, actions = step(run, NetReady(2, error=why, silent=(0,)), 2)
    assert KeepApart(PathClass.DIRECT, (("w0", "w2"),)) in actions
    assert actions[-1] == SetJobState(
        J.QUEUED,
        f"epoch 1 fenced: node2 (worker w2) could not set up the direct path: {why}; "
        "placing the gang again, keeping w0 and w2 apart on the direct path",
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


def running() -> GangRun:
    """The 3-member direct gang, every member assigned and running."""
    run = placed()
    for key in KEYS:
        run, _ = step(run, key, 1)
    for node in range(3):
        run, _ = step(run, NetUp(node), 1)
    run, _ = step(run, PortPublished(0, "100.64.0.1", 29500), 2)
    for node in range(3):
        run, _ = step(run, MasterChecked(node, None, "2.13.0"), 2)
    for node in range(3):
        run, _ = step(run, MemberStarted(node), 3)
    assert run.job_state is J.RUNNING
    return run


def test_a_running_pair_that_loses_its_path_sets_network_degraded_until_it_is_back() -> None:
    run = running()
    run, actions = step(run, NetPath(0, (2,)), 4)
    lost = "epoch 1: node0 (worker w0) hears nothing from node2"
    assert actions[0] == SetCondition("NetworkDegraded", True, "DirectPathLost", lost)
    assert run.job_state is J.RUNNING  # training goes on
    _, again = step(run, NetPath(0, (2,)), 5)
    assert again == ()  # the same report changes nothing
    run, actions = step(run, NetPath(2, (0,)), 5)
    assert actions[0] == SetCondition(
        "NetworkDegraded",
        True,
        "DirectPathLost",
        "epoch 1: node0 (worker w0) hears nothing from node2; "
        "node2 (worker w2) hears nothing from node0",
    )
    run, actions = step(run, NetPath(0, ()), 6)
    assert isinstance(actions[0], SetCondition)
    assert actions[0].status is True  # node2 still hears nothing from node0
    run, actions = step(run, NetPath(2, ()), 7)
    assert actions[0] == SetCondition(
        "NetworkDegraded",
        False,
        "DirectPathRestored",
        "epoch 1: every pair hears each other again",
    )
    assert not run.degraded


def test_path_reports_outside_a_running_direct_gang_are_ignored() -> None:
    assert step(placed(), NetPath(0, (1,)), 1)[1] == ()  # nobody assigned yet
    run, _ = step(GangRun(), Placed("job1", 1, W, PathClass.PRIVATE), 0)
    assert step(run, NetPath(0, (1,)), 1)[1] == ()


def test_a_controller_restart_mid_network_fences_the_epoch_and_queues_the_job_again() -> None:
    """The join keys, mesh addresses and probe went with the controller's memory; nothing
    of the user's ran, so the epoch is fenced and the gang placed again (not failed)."""
    restored = GangRun.restore(
        "job1",
        2,
        PathClass.DIRECT,
        J.NETWORKING,
        [MemberSnapshot(w, M.PENDING) for w in W],
    )
    run, actions = step(restored, ControllerRestarted(grace_deadline=30.0), 0)
    assert run.fenced
    assert run.settled
    state = actions[-1]
    assert isinstance(state, SetJobState)
    assert state.state is J.QUEUED
    assert state.reason == (
        "epoch 2 fenced: the controller restarted while the gang's network was being set up; "
        "placing the gang again"
    )
    assert [a.worker for a in actions if isinstance(a, ReleaseWorker)] == list(W)
    # A private gang caught mid-probe is probed again in its next epoch, too.
    private = GangRun.restore(
        "job1", 1, PathClass.PRIVATE, J.NETWORKING, [MemberSnapshot(w, M.PENDING) for w in W]
    )
    assert step(private, ControllerRestarted(grace_deadline=30.0), 0)[0].fenced


def test_a_peer_that_finished_is_not_missed_and_its_exit_clears_what_it_missed() -> None:
    run = running()
    run, _ = step(run, MemberExited(1, 0), 4)  # node1 done: its device went with it
    _, actions = step(run, NetPath(0, (1,)), 70)
    assert actions == ()  # not a lost path: a finished peer
    run, actions = step(run, NetPath(2, (0,)), 70)
    assert actions[0].status is True  # type: ignore[union-attr]
    run, actions = step(run, MemberExited(2, 0), 71)
    assert (
        SetCondition(
            "NetworkDegraded",
            False,
            "DirectPathRestored",
            "epoch 1: every pair hears each other again",
        )
        in actions
    )


def test_after_a_controller_restart_the_agents_first_path_report_sets_the_condition() -> None:
    """Whether a pair was degraded went with the controller's memory; the agents say their
    paths again on their new links, and an all-clear clears a condition left true."""
    restored = GangRun.restore(
        "job1",
        1,
        PathClass.DIRECT,
        J.RUNNING,
        [MemberSnapshot(w, M.RUNNING) for w in W],
        published=("100.64.0.1", 29500),
    )
    run, _ = step(restored, ControllerRestarted(grace_deadline=30.0), 0)
    assert run.degraded is None
    run, actions = step(run, NetPath(0, ()), 1)
    assert actions[0] == SetCondition(
        "NetworkDegraded", False, "DirectPathRestored", "epoch 1: every pair hears each other again"
    )
    assert step(run, NetPath(1, ()), 1)[1] == ()  # known now: nothing to say


def test_a_member_that_does_not_dial_back_before_anything_started_fences_the_epoch() -> None:
    restored = GangRun.restore(
        "job1", 1, PathClass.PRIVATE, J.RENDEZVOUS, [MemberSnapshot(w, M.PENDING) for w in W]
    )
    run, _ = step(restored, ControllerRestarted(grace_deadline=30.0), 0)
    for w in W[:2]:
        run, _ = step(run, LinkBack(w, ()), 1)
    run, actions = step(run, Tick(), 31)
    assert run.fenced
    state = actions[-1]
    assert isinstance(state, SetJobState)
    assert state.state is J.QUEUED
    assert "node2 (worker w2) did not dial back within the grace" in state.reason
