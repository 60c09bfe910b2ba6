"""The probe in the gang lifecycle: every pair measured once, the slowest pair reported, and
the rendezvous only after it; a pair that cannot connect fences the epoch naming it, and
the gang is placed again with that pair kept apart on the path."""

from __future__ import annotations

from muster.gang import (
    GangRun,
    KeepApart,
    LinkLost,
    NetReady,
    NetUp,
    Placed,
    ProbeDone,
    ProbePair,
    ProbeReady,
    RecordEvent,
    SendPrepareRendezvous,
    SendProbeListen,
    SendProbeRun,
    SendStop,
    SetCondition,
    SetJobState,
    SmallerPackets,
    Tick,
    step,
)
from muster.gang.turn import MAX_NETWORK_EPOCHS
from muster.spec import JobState, PathClass

J = JobState
W = ("w0", "w1", "w2")
PLACED = Placed("job1", 1, W, PathClass.PRIVATE, master_addr="10.0.0.1", probe_seconds=1.0)


def listening() -> GangRun:
    run, actions = step(GangRun(), PLACED, 0)
    assert actions == (
        SetJobState(J.NETWORKING, "epoch 1: probing the private path between 3 members"),
        *(SendProbeListen(n, W[n]) for n in range(3)),
    )
    run, _ = step(run, ProbeReady(0, 40000), 1)
    run, _ = step(run, ProbeReady(2, 40002), 1)
    run, actions = step(run, ProbeReady(1, 40001), 1)
    # Rounds of disjoint pairs (3 nodes: one pair a round): 1-2, then 0-2, then 0-1.
    assert actions == (SendProbeRun(1, "w1", ((2, 40002),), 1.0),)
    return run


def test_each_pair_is_measured_once_and_the_slowest_is_reported_before_the_rendezvous() -> None:
    run = listening()
    run, actions = step(run, ProbeDone(1, (ProbePair(2, 3, rtt_ms=0.2, gbps=9.5),)), 2)
    assert actions == (SendProbeRun(0, "w0", ((2, 40002),), 1.0),)
    run, actions = step(run, ProbeDone(0, (ProbePair(2, 3, rtt_ms=0.3, gbps=4.25),)), 3)
    assert actions == (SendProbeRun(0, "w0", ((1, 40001),), 1.0),)
    run, actions = step(run, ProbeDone(0, (ProbePair(1, 3, rtt_ms=0.1, gbps=12.0),)), 4)
    summary = "slowest pair node0-node2: 4.25 Gbit/s, RTT 0.3 ms on the private path (3 pairs)"
    assert actions[0] == SetCondition("NetworkQualified", True, "ProbePassed", summary)
    event = actions[1]
    assert isinstance(event, RecordEvent)
    assert event.kind == "Probe"
    assert event.data["slowest"] == {"a": 0, "b": 2, "tcpGbps": 4.25, "rttMs": 0.3}
    none = {"via": None, "endpoint": None}
    assert event.data["pairs"] == [
        {"a": 0, "b": 1, "tcpGbps": 12.0, "rttMs": 0.1, **none},
        {"a": 0, "b": 2, "tcpGbps": 4.25, "rttMs": 0.3, **none},
        {"a": 1, "b": 2, "tcpGbps": 9.5, "rttMs": 0.2, **none},
    ]
    assert actions[2:] == (
        SetCondition("GangReady", True, "NetworkReady", "epoch 1: 3 members on the private path"),
        SetJobState(J.RENDEZVOUS, "epoch 1: waiting for node0 to publish its address"),
        SendPrepareRendezvous("w0", "10.0.0.1", None),
    )
    assert run.job_state is J.RENDEZVOUS


def test_four_nodes_are_probed_in_three_rounds_of_two_disjoint_pairs() -> None:
    workers = ("w0", "w1", "w2", "w3")
    run, _ = step(GangRun(), Placed("job1", 1, workers, PathClass.PRIVATE, probe_seconds=1.0), 0)
    for node in range(4):
        run, actions = step(run, ProbeReady(node, 40000 + node), 1)
    assert actions == (
        SendProbeRun(0, "w0", ((3, 40003),), 1.0),
        SendProbeRun(1, "w1", ((2, 40002),), 1.0),
    )
    run, actions = step(run, ProbeDone(0, (ProbePair(3, 3, 0.1, 1.0),)), 2)
    assert actions == ()  # the round waits for its other pair
    run, actions = step(run, ProbeDone(1, (ProbePair(2, 3, 0.1, 1.0),)), 2)
    assert actions == (
        SendProbeRun(0, "w0", ((2, 40002),), 1.0),
        SendProbeRun(1, "w1", ((3, 40003),), 1.0),
    )


def test_a_pair_that_cannot_connect_fences_the_epoch_and_keeps_the_pair_apart() -> None:
    run = listening()
    bad = ProbePair(2, 1, error="1 of 3 connections to 10.0.0.3:40002 (TimeoutError)")
    run, actions = step(run, ProbeDone(1, (bad,)), 2)
    cause = (
        "the probe failed from node1 (worker w1) to node2 (worker w2): "
        "1 of 3 connections to 10.0.0.3:40002 (TimeoutError)"
    )
    assert actions[0] == SetCondition("NetworkQualified", False, "ProbeFailed", cause)
    assert KeepApart(PathClass.PRIVATE, (("w1", "w2"),)) in actions
    assert actions[-1] == SetJobState(
        J.QUEUED,
        f"epoch 1 fenced: {cause}; placing the gang again, keeping w1 and w2 apart on the "
        "private path",
    )
    fenced = [a for a in actions if isinstance(a, RecordEvent) and a.kind == "EpochFenced"]
    assert fenced[0].data == {
        "epoch": 1,
        "path": "private",
        "reason": "ProbeFailed",
        "apart": [["w1", "w2"]],
    }
    # Nothing was started; every member's probe endpoint is told to close.
    assert [a.worker for a in actions if isinstance(a, SendStop)] == list(W)
    assert run.settled


def test_a_member_that_cannot_listen_fences_the_epoch() -> None:
    run, _ = step(GangRun(), PLACED, 0)
    run, actions = step(run, ProbeReady(1, error="listening on 10.0.0.2: address not here"), 1)
    state = actions[-1]
    assert isinstance(state, SetJobState)
    assert state.state is J.QUEUED
    assert state.reason.startswith(
        "epoch 1 fenced: node1 (worker w1) could not open its probe endpoint: "
        "listening on 10.0.0.2: address not here"
    )
    # Every member was asked to listen: each is told to close its endpoint, answered or not.
    assert [a.worker for a in actions if isinstance(a, SendStop)] == list(W)


def test_without_a_probe_the_rendezvous_starts_at_once() -> None:
    _, actions = step(GangRun(), Placed("job1", 1, W, PathClass.PRIVATE), 0)
    assert isinstance(actions[-1], SendPrepareRendezvous)


def test_a_probe_report_of_the_wrong_peer_fails_the_epoch_and_a_stray_one_is_ignored() -> None:
    run = listening()
    _, actions = step(run, ProbeDone(0, (ProbePair(1, 3, rtt_ms=0.1, gbps=1.0),)), 2)
    assert actions == ()  # node 0 measures nothing in this round
    run, actions = step(run, ProbeDone(1, ()), 2)
    assert actions[0] == SetJobState(
        J.FAILED, "node1 (worker w1) reported a probe of nodes [], not of [2]"
    )


def test_readiness_only_reports_the_slowest_round_trip() -> None:
    run, _ = step(GangRun(), Placed("job1", 1, W[:2], PathClass.PRIVATE, probe_seconds=0.0), 0)
    run, _ = step(run, ProbeReady(0, 40000), 1)
    run, actions = step(run, ProbeReady(1, 40001), 1)
    assert actions == (SendProbeRun(0, "w0", ((1, 40001),), 0.0),)
    run, actions = step(run, ProbeDone(0, (ProbePair(1, 3, rtt_ms=0.4),)), 2)
    assert actions[0] == SetCondition(
        "NetworkQualified",
        True,
        "ProbePassed",
        "slowest pair node0-node1: RTT 0.4 ms on the private path (1 pairs)",
    )


def test_the_probe_deadline_grows_with_the_gang_and_the_sample() -> None:
    workers = tuple(f"w{i}" for i in range(10))
    placed = Placed("job1", 1, workers, PathClass.PRIVATE, probe_seconds=20.0)
    run, _ = step(GangRun(), placed, 0)
    budget = 120 + 9 * (20 + 30)  # 10 nodes: 9 rounds
    _, actions = step(run, Tick(), budget - 1)
    assert actions == ()
    _, actions = step(run, Tick(), budget + 1)
    state = actions[-1]
    assert isinstance(state, SetJobState)
    assert state.state is J.QUEUED
    assert state.reason.startswith(
        f"epoch 1 fenced: the probe did not finish within {budget}s: node0 (worker w0)"
    )


def test_a_direct_pair_whose_traffic_left_by_another_interface_is_fenced() -> None:
    """Read from the data plane: on the direct path every pair's traffic must leave by
    muster0; a route that takes the mesh's addresses elsewhere is not the direct path."""
    placed = Placed("job1", 1, W[:2], PathClass.DIRECT, probe_seconds=0.0)
    run, _ = step(GangRun(), placed, 0)
    run, _ = step(run, NetReady(0, "k0=", "10.0.0.1:1"), 0)
    run, _ = step(run, NetReady(1, "k1=", "10.0.0.2:1"), 0)
    run, _ = step(run, NetUp(0), 0)
    run, _ = step(run, NetUp(1), 0)
    run, _ = step(run, ProbeReady(0, 40000), 1)
    run, _ = step(run, ProbeReady(1, 40001), 1)
    good = ProbePair(1, 3, rtt_ms=0.4, via="muster0", endpoint="10.0.0.2:1")
    _, actions = step(run, ProbeDone(0, (good,)), 2)
    assert isinstance(actions[0], SetCondition)
    assert actions[0].status is True
    bad = ProbePair(1, 3, rtt_ms=0.4, via="eth0")
    run, actions = step(run, ProbeDone(0, (bad,)), 2)
    assert actions[0] == SetCondition(
        "NetworkQualified",
        False,
        "PathNotDirect",
        "the probe's traffic from node0 (worker w0) to node1 (worker w1) left by eth0, "
        "not muster0: not the direct path",
    )
    assert KeepApart(PathClass.DIRECT, (("w0", "w1"),)) in actions
    assert run.fenced


def test_the_direct_path_is_the_members_own_device_whatever_its_name() -> None:
    """A second agent on a host makes muster1: its traffic leaving by muster1 is the
    direct path; by muster0 (another agent's device) it is not."""
    placed = Placed("job1", 1, W[:2], PathClass.DIRECT, probe_seconds=0.0)
    run, _ = step(GangRun(), placed, 0)
    for event in (NetReady(0, "k0=", "10.0.0.1:1"), NetReady(1, "k1=", "10.0.0.2:1")):
        run, _ = step(run, event, 0)
    run, _ = step(run, NetUp(0), 0)
    run, _ = step(run, NetUp(1), 0)
    run, _ = step(run, ProbeReady(0, 40000), 1)
    run, _ = step(run, ProbeReady(1, 40001), 1)
    own = ProbePair(1, 3, rtt_ms=0.4, via="muster1", endpoint="10.0.0.2:1")
    _, actions = step(run, ProbeDone(0, (own,), device="muster1"), 2)
    assert actions[0] == SetCondition("NetworkQualified", True, "ProbePassed", actions[0].message)
    run, actions = step(run, ProbeDone(0, (own,), device="muster0"), 2)
    assert isinstance(actions[0], SetCondition)
    assert actions[0].reason == "PathNotDirect"
    assert "left by muster1, not muster0" in actions[0].message
    assert run.fenced


def _direct_pair_probed(
    mtus: tuple[int | None, int | None], bad: ProbePair, epoch: int = 1
) -> tuple[GangRun, tuple[object, ...]]:
    placed = Placed("job1", epoch, W[:2], PathClass.DIRECT, probe_seconds=1.0)
    run, _ = step(GangRun(), placed, 0)
    for node in (0, 1):
        run, _ = step(run, NetReady(node, f"k{node}=", f"10.0.0.{node + 1}:1", mtu=mtus[node]), 0)
    run, _ = step(run, NetUp(0), 0)
    run, _ = step(run, NetUp(1), 0)
    run, _ = step(run, ProbeReady(0, 40000), 1)
    run, _ = step(run, ProbeReady(1, 40001), 1)
    return step(run, ProbeDone(0, (bad,)), 2)


def test_a_direct_pair_above_1280_that_connects_then_stalls_is_placed_again_with_1280() -> None:
    """Devices above 1280 (hosts in one declared region) over a path that carries less than
    its links say: the handshake and the connections pass, the transfer stalls. The next
    epoch tries 1280 for the job's direct gangs before any pair is kept apart."""
    stalled = ProbePair(1, 3, error="measuring 100.64.0.2:40001: TimeoutError('timed out')")
    run, actions = _direct_pair_probed((1420, 1380), stalled)
    assert run.fenced
    assert SmallerPackets(1280) in actions
    assert not [a for a in actions if isinstance(a, KeepApart)]
    fenced = next(a for a in actions if isinstance(a, RecordEvent) and a.kind == "EpochFenced")
    assert fenced.data["mtu"] == 1280
    assert fenced.data["apart"] == []
    assert "(their devices' MTU: 1420 and 1380)" in fenced.message
    assert fenced.message.endswith(
        "placing the gang again with MTU 1280 (a --direct-mtu 1280 on these hosts' agents "
        "says it at once)"
    ), fenced.message
    # At 1280 already (the next epoch), or an agent that said no MTU: the pair is kept apart.
    for mtus in ((1280, 1280), (None, None)):
        run, actions = _direct_pair_probed(mtus, stalled)
        assert KeepApart(PathClass.DIRECT, (("w0", "w1"),)) in actions, mtus
        assert not [a for a in actions if isinstance(a, SmallerPackets)]
    # No connection at all is no packet size's doing: kept apart at once.
    refused = ProbePair(1, 0, error="0 of 3 connections to 100.64.0.2:40001 in 1s (refused)")
    _, actions = _direct_pair_probed((1420, 1420), refused)
    assert KeepApart(PathClass.DIRECT, (("w0", "w1"),)) in actions
    assert not [a for a in actions if isinstance(a, SmallerPackets)]


FOUR = ("w0", "w1", "w2", "w3")


def _four_probing() -> GangRun:
    """4 members, endpoints open: round 1 measures 0-3 and 1-2 at once."""
    run, _ = step(GangRun(), Placed("job1", 1, FOUR, PathClass.PRIVATE, probe_seconds=1.0), 0)
    for node in range(4):
        run, _ = step(run, ProbeReady(node, 40000 + node), 1)
    return run


def _direct_probing(workers: tuple[str, ...], epoch: int) -> GangRun:
    """``workers`` on the direct path at ``epoch``, devices at MTU 1420, endpoints open."""
    placed = Placed("job1", epoch, workers, PathClass.DIRECT, probe_seconds=1.0)
    run, _ = step(GangRun(), placed, 0)
    nodes = range(len(workers))
    for node in nodes:
        run, _ = step(run, NetReady(node, f"k{node}=", f"10.0.0.{node + 1}:1", mtu=1420), 0)
    for node in nodes:
        run, _ = step(run, NetUp(node), 0)
    for node in nodes:
        run, _ = step(run, ProbeReady(node, 40000 + node), 1)
    return run


def test_every_pair_that_fails_in_a_round_is_kept_apart_in_one_fence() -> None:
    """Two pairs of one round fail: the epoch is fenced once the round's reports are in,
    keeping both apart (one epoch for both, not one each of the job's few)."""
    run = _four_probing()
    refused = ProbePair(3, 0, error="connection refused")
    run, actions = step(run, ProbeDone(0, (refused,)), 2)
    assert actions == ()  # 1-2 is still measuring
    stalled = ProbePair(2, 1, error="1 of 3 connections (TimeoutError)")
    run, actions = step(run, ProbeDone(1, (stalled,)), 3)
    assert KeepApart(PathClass.PRIVATE, (("w0", "w3"), ("w1", "w2"))) in actions
    state = actions[-1]
    assert isinstance(state, SetJobState)
    assert state.state is J.QUEUED
    assert state.reason.startswith(
        "epoch 1 fenced: the probe failed from node0 (worker w0) to node3 (worker w3): "
        "connection refused; and 1 more pair of the round failed"
    ), state.reason
    assert run.fenced


def test_a_failed_pair_beside_one_that_never_reports_is_named_at_the_deadline() -> None:
    run = _four_probing()
    run, actions = step(run, ProbeDone(0, (ProbePair(3, 0, error="connection refused"),)), 2)
    assert actions == ()
    assert run.rendezvous_deadline is not None
    run, actions = step(run, Tick(), run.rendezvous_deadline + 1)
    apart = next(a for a in actions if isinstance(a, KeepApart))
    assert ("w0", "w3") in apart.pairs  # the refused pair, and node1 apart from everyone
    assert ("w0", "w1") in apart.pairs
    state = actions[-1]
    assert isinstance(state, SetJobState)
    assert "node1 (worker w1) did not report" in state.reason
    assert "to node3 (worker w3): connection refused" in state.reason


def test_a_spare_epoch_lets_the_last_counted_epoch_be_placed_again() -> None:
    """At MAX_NETWORK_EPOCHS a fenced epoch fails the job, unless the run has a spare (its
    job had an epoch fenced for its packets' size alone)."""
    bad = ProbePair(2, 1, error="1 of 3 connections (TimeoutError)")
    states = []
    for spare in (0, 1):
        placed = Placed(
            "job1", MAX_NETWORK_EPOCHS, W, PathClass.PRIVATE, probe_seconds=1.0,
            spare_epochs=spare,
        )  # fmt: skip
        run, _ = step(GangRun(), placed, 0)
        for node in range(3):
            run, _ = step(run, ProbeReady(node, 40000 + node), 1)
        run, actions = step(run, ProbeDone(1, (bad,)), 2)
        states.append(next(a.state for a in actions if isinstance(a, SetJobState)))
    assert states == [J.FAILED, J.QUEUED]


def test_a_pair_failed_in_the_round_is_kept_apart_when_a_lost_member_fences_it() -> None:
    """A failure the round collected is not lost when something else ends the epoch first."""
    run = _four_probing()
    run, actions = step(run, ProbeDone(0, (ProbePair(3, 0, error="connection refused"),)), 2)
    assert actions == ()
    run, actions = step(run, LinkLost("w1", "its link dropped"), 3)
    apart = next(a for a in actions if isinstance(a, KeepApart))
    assert ("w0", "w3") in apart.pairs
    fenced = next(a for a in actions if isinstance(a, RecordEvent) and a.kind == "EpochFenced")
    assert "to node3 (worker w3): connection refused" in fenced.message


def test_a_stall_above_1280_in_the_last_counted_epoch_still_gets_its_try_at_1280() -> None:
    stalled = ProbePair(1, 3, error="measuring 100.64.0.2:40001: TimeoutError('timed out')")
    run, actions = _direct_pair_probed((1420, 1420), stalled, epoch=MAX_NETWORK_EPOCHS)
    assert SmallerPackets(1280) in actions
    assert run.job_state is J.QUEUED
    # ... but a pair kept apart there is the job's own failure: it ends the job.
    refused = ProbePair(1, 0, error="0 of 3 connections (refused)")
    run, _ = _direct_pair_probed((1420, 1420), refused, epoch=MAX_NETWORK_EPOCHS)
    assert run.job_state is J.FAILED


def test_a_member_lost_in_the_last_counted_epoch_ends_the_job_whatever_the_round_saw() -> None:
    """A stall collected in the round does not turn a lost member's fence into a packet-size
    one: that fence counts (the job fails at its last epoch), and the lost member's stall
    asks for no smaller packets."""
    run = _direct_probing(W, MAX_NETWORK_EPOCHS)
    # Round 1 of 3 nodes is the pair 1-2: node1 reports node2 stalled.
    stalled = ProbePair(2, 3, error="measuring 100.64.0.3:40002: TimeoutError('timed out')")
    run, actions = step(run, ProbeDone(1, (stalled,)), 2)
    assert isinstance(actions[-1], SetJobState)  # (one pair a round: the round is over)
    assert actions[-1].state is J.QUEUED  # a stall alone: its try at 1280, not counted
    # The same at the last epoch, but node2 is lost before the round ends: counted.
    run = _direct_probing(FOUR, MAX_NETWORK_EPOCHS)
    run, actions = step(run, ProbeDone(1, (stalled,)), 2)  # 1-2 stalled; 0-3 measuring
    assert actions == ()
    run, actions = step(run, LinkLost("w2", "its link dropped"), 3)
    assert run.job_state is J.FAILED
    assert not [a for a in actions if isinstance(a, SmallerPackets)]


def test_a_round_with_a_stall_and_a_refusal_names_the_refusal_and_counts_the_stall() -> None:
    run = _direct_probing(FOUR, 1)
    stalled = ProbePair(3, 3, error="measuring: TimeoutError('timed out')")
    refused = ProbePair(2, 0, error="connection refused")
    run, _ = step(run, ProbeDone(0, (stalled,)), 2)
    run, actions = step(run, ProbeDone(1, (refused,)), 3)
    assert SmallerPackets(1280) in actions
    assert KeepApart(PathClass.DIRECT, (("w1", "w2"),)) in actions
    state = actions[-1]
    assert isinstance(state, SetJobState)
    assert state.reason.startswith(
        "epoch 1 fenced: the probe failed from node1 (worker w1) to node2 (worker w2): "
        "connection refused; and 1 more pair of the round failed; placing"
    ), state.reason
