"""The relayed path in the gang lifecycle: keys (no endpoint: the relays are it), peers, the
shim's self-test, then the rendezvous through the relays."""

from __future__ import annotations

from muster.gang import (
    GangRun,
    NetReady,
    NetUp,
    Placed,
    RecordEvent,
    SendNetPeers,
    SendNetSetup,
    SendPrepareRendezvous,
    SendStop,
    SetCondition,
    SetJobState,
    step,
)
from muster.spec import JobState, PathClass

J = JobState
W = ("w0", "w1")
PLACED = Placed("job1", 1, W, PathClass.RELAYED, master_addr="10.77.1.13")
KEYS = tuple(NetReady(n, f"key{n}=", "") for n in range(2))


def placed() -> GangRun:
    run, actions = step(GangRun(), PLACED, 0)
    assert actions == (
        SetJobState(J.NETWORKING, "epoch 1: setting up the relayed network between 2 members"),
        *(SendNetSetup(n, W[n]) for n in range(2)),
    )
    return run


def test_relayed_keys_need_no_endpoint_and_the_rendezvous_follows_the_links() -> None:
    run = placed()
    run, _ = step(run, KEYS[0], 1)
    run, actions = step(run, KEYS[1], 1)
    assert actions == (
        SendNetPeers(0, "w0", ((1, "key1=", ""),)),
        SendNetPeers(1, "w1", ((0, "key0=", ""),)),
    )
    run, _ = step(run, NetUp(0), 2)
    run, actions = step(run, NetUp(1), 2)
    assert actions[0] == RecordEvent(
        "NetworkReady",
        "epoch 1: relayed network up between 2 members",
        {"epoch": 1, "path": "relayed"},
    )
    assert actions[-1] == SendPrepareRendezvous("w0", "10.77.1.13", None)


def test_a_launcher_that_ignores_the_shim_fails_the_job_at_once_naming_it() -> None:
    run = placed()
    why = "the launcher /opt/py/bin/python did not load libmuster-netshim.so (no output)"
    run, actions = step(run, NetReady(1, error=why, shim_not_loaded=True), 1)
    assert run.job_state is J.FAILED
    assert run.reason == f"ShimNotLoaded: node1 (worker w1): {why}"
    assert SetCondition("GangReady", False, "ShimNotLoaded", f"node1 (worker w1): {why}") in (
        actions
    )
    assert not run.fenced, "placing it again would not help"
    assert {a.worker for a in actions if isinstance(a, SendStop)} == {"w0", "w1"}


def test_a_member_no_relay_admitted_fences_the_epoch() -> None:
    run = placed()
    why = "no relay admitted this member within 30s (10.77.1.2:7101): timed out"
    run, actions = step(run, NetReady(0, error=why), 1)
    assert run.fenced
    fenced = next(a for a in actions if isinstance(a, RecordEvent) and a.kind == "EpochFenced")
    assert fenced.data["reason"] == "RelayedPathFailed"
    assert f"node0 (worker w0) could not set up the relayed path: {why}" in fenced.message
