"""A member frame's body, whatever an agent puts in it, is read into the run's event or
refused as malformed (KeyError, TypeError, ValueError: the controller counts and skips
those); no other error escapes into the link's handling. Examples:
``MUSTER_HYPOTHESIS_EXAMPLES`` (default 300)."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from muster.controller.frames import member_event, member_report
from muster.controller.runs import RunEntry
from muster.gang import (
    GangRun,
    MemberExited,
    MemberReport,
    NetReady,
    OutputsStored,
    Placed,
    ProbeDone,
    step,
)
from muster.spec import JobSpec, PathClass
from muster.wire import Kind
from tests.controller.helpers import direct_worker

EXAMPLES = int(os.environ.get("MUSTER_HYPOTHESIS_EXAMPLES", "300"))
WORKERS = ("w0", "w1", "w2")
MEMBER_KINDS = (
    Kind.NET_READY,
    Kind.NET_UP,
    Kind.PROBE_READY,
    Kind.PROBE_DONE,
    Kind.NET_PATH,
    Kind.HUNG,
    Kind.RENDEZVOUS_READY,
    Kind.MASTER_CHECKED,
    Kind.MEMBER_STARTED,
    Kind.MEMBER_EXITED,
    Kind.ARTIFACTS_DONE,
)
# The keys agents send, and some they do not.
KEYS = st.sampled_from(
    [
        "error", "silent", "shim_not_loaded", "public_key", "port", "public", "mtu", "pairs",
        "device", "lost", "ranks", "hung", "silent_s", "addr", "torch", "nccl", "exit_code",
        "signal", "failed_rank", "failed_exit", "tail", "errors", "files", "node", "connects",
        "rtt_ms", "gbps", "via", "endpoint", "job", "epoch", "node_rank", "last_log_seq",
    ]
) | st.text(max_size=4)  # fmt: skip
# What a JSON body can hold once orjson decoded it (no NaN, no infinity).
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from(["100.64.0.2", "10.0.0.1", "::1", "a" * 43 + "=", "eth0"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4),
    max_leaves=12,
)
BODIES = st.dictionaries(KEYS, JSON, max_size=8)


def entry(path: PathClass) -> RunEntry:
    inventories = [direct_worker(i, w) for i, w in enumerate(WORKERS)]
    spec = JobSpec.model_validate(
        {
            "name": "frames",
            "entrypoint": "t.py",
            "distributed": {"num_workers": 3, "procs_per_worker": 1, "backend": "gloo"},
        }
    )
    run, _ = step(GangRun(), Placed("j", 1, WORKERS, path), 0.0)
    return RunEntry(run, spec, inventories, None, offered_mtu=1420)


ENTRIES = {path: entry(path) for path in (PathClass.DIRECT, PathClass.RELAYED)}


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(MEMBER_KINDS),
    path=st.sampled_from(list(ENTRIES)),
    node=st.integers(0, 2),
    body=BODIES,
)
def test_any_body_is_read_or_refused_as_malformed(
    kind: Kind, path: PathClass, node: int, body: dict[str, Any]
) -> None:
    try:
        event = member_event(ENTRIES[path], node, kind, body)
    except (KeyError, TypeError, ValueError):
        return
    assert event is not None
    assert getattr(event, "node", node) == node


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=JSON)
def test_any_reported_member_is_read_or_refused_as_malformed(raw: Any) -> None:
    with contextlib.suppress(KeyError, TypeError, ValueError):
        member_report(raw)


def test_the_bodies_agents_send_are_read() -> None:
    direct = ENTRIES[PathClass.DIRECT]
    ready = member_event(
        direct,
        1,
        Kind.NET_READY,
        {"public_key": "A" * 43 + "=", "port": 51820, "mtu": 1420},
    )
    assert ready == NetReady(1, "A" * 43 + "=", "10.0.0.2:51820", mtu=1420)
    # an MTU above what the epoch offered is not believed
    over = member_event(
        direct, 1, Kind.NET_READY, {"public_key": "A" * 43 + "=", "port": 1, "mtu": 9000}
    )
    assert isinstance(over, NetReady)
    assert over.mtu is None
    pairs = {"pairs": [{"node": 2, "connects": 3, "rtt_ms": 0.2, "gbps": 9.5}], "device": "muster0"}
    done = member_event(direct, 0, Kind.PROBE_DONE, pairs)
    assert isinstance(done, ProbeDone)
    assert done.pairs[0].gbps == 9.5
    exited = member_event(direct, 2, Kind.MEMBER_EXITED, {"exit_code": 3, "tail": ["boom"]})
    assert exited == MemberExited(
        node=2, exit_code=3, signal=None, failed_rank=None, failed_exit=None, tail=("boom",)
    )
    stored = member_event(direct, 0, Kind.ARTIFACTS_DONE, {"errors": ["disk full"]})
    assert stored == OutputsStored(0, ok=False, errors=("disk full",))
    assert member_event(direct, 0, Kind.RELAY_TICKETS, {}) is None
    # on the relayed path a key is all (the relays are its endpoint)
    relayed = member_event(
        ENTRIES[PathClass.RELAYED], 2, Kind.NET_READY, {"public_key": "B" * 43 + "="}
    )
    assert relayed == NetReady(2, "B" * 43 + "=", "")
    # a member that could not join names the peers it never heard from, by node
    failed = member_event(
        direct, 0, Kind.NET_READY, {"error": "no handshake", "silent": ["100.64.0.3", "1.2.3.4"]}
    )
    assert failed == NetReady(0, error="no handshake", silent=(2,))
    report = member_report(
        {"job": "j", "epoch": 1, "node_rank": 2, "exit_code": None, "last_log_seq": 7}
    )
    assert report == MemberReport(
        job="j", epoch=1, node=2, exit_code=None, signal=None, last_log_seq=7
    )
