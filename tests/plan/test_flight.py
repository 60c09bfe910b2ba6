"""Reading where a rank is parked from torch's flight recorder (muster.plan.stacks.parked),
and when muster asks the ranks to serve it (muster.plan.env.flight_recorder_on)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from muster.plan.env import DIAG_DIR_ENV, flight_recorder_on
from muster.plan.stacks import folded, parked, parked_line
from muster.train import flight


def _entry(seq: int, retired: bool, created: int, **extra: Any) -> dict[str, Any]:
    """One entry as torch 2.13's fr_trace_json writes it (captured from a gloo job)."""
    return {
        "collective_seq_id": seq,
        "input_dtypes": ["Float"],
        "input_sizes": [[1000]],
        "is_p2p": False,
        "op_id": seq,
        "output_dtypes": ["Float"],
        "output_sizes": [[1000]],
        "p2p_seq_id": 0,
        "pg_id": 0,
        "process_group": ["0", "default_pg"],
        "profiling_name": "gloo:all_reduce",
        "record_id": seq - 1,
        "retired": retired,
        "state": "scheduled",
        "thread_id": "140673925667712",
        "thread_name": "python",
        "time_created_ns": created,
        "time_discovered_completed_ns": 0,
        "time_discovered_started_ns": 0,
        "timeout_ms": 1800000,
        **extra,
    }


def _dump(*entries: dict[str, Any]) -> dict[str, Any]:
    return {"version": "2.10", "comm_lib_version": "", "entries": list(entries), "pg_status": {}}


NOW = 1_796_059_050_000_000_000


def test_a_rank_in_a_collective_is_parked_in_its_oldest_unretired_one() -> None:
    dump = _dump(
        _entry(3, True, NOW - 9_000_000_000),
        _entry(4, False, NOW - 8_000_000_000),
        _entry(5, False, NOW - 1_000_000_000),  # queued behind it (async_op)
    )
    where = parked(dump, NOW)
    assert (where["seq"], where["op"], where["group"]) == (4, "all_reduce", "default_pg")
    assert (where["age_s"], where["sizes"]) == (8.0, [[1000]])
    line = parked_line(where)
    assert line == (
        "collective: in all_reduce #4 on default_pg (Float[1000]), scheduled (flight recorder)"
    )


def test_an_nccl_entry_names_its_state_and_a_p2p_its_own_sequence() -> None:
    nccl = _entry(
        12, False, NOW - 2_000_000_000, profiling_name="nccl:send", is_p2p=True, p2p_seq_id=7
    )
    nccl["state"] = "started"
    where = parked(_dump(nccl), NOW)
    assert (where["op"], where["seq"], where["state"]) == ("send", 7, "started")


def test_a_rank_between_collectives_names_its_last_one() -> None:
    where = parked(_dump(_entry(2, True, NOW - 5), _entry(3, True, NOW - 4)), NOW)
    assert where == {"seq": None, "last_seq": 3, "last_op": "all_reduce", "group": "default_pg"}
    assert parked_line(where).startswith("collective: none in flight; last all_reduce #3")
    assert parked(_dump(), NOW) == {"seq": None}
    assert parked_line(None) == ""


def test_ranks_in_different_collectives_do_not_fold_together() -> None:
    stack = 'Thread 1 (idle): "MainThread"\n    all_reduce (c10d.py:1)'
    behind = parked(_dump(_entry(3, True, NOW - 9), _entry(4, False, NOW - 8)), NOW)
    ahead = parked(_dump(_entry(4, True, NOW - 9), _entry(5, False, NOW - 8)), NOW)
    stacks = [{"rank": r, "text": stack, "collective": behind} for r in (0, 1, 2)]
    stacks.append({"rank": 3, "text": stack, "collective": ahead})
    groups = folded(stacks)
    assert [ranks for ranks, _ in groups] == [[3], [0, 1, 2]], groups
    assert groups[0][1].startswith("collective: in all_reduce #5")


@pytest.mark.parametrize(
    ("env", "on"),
    [
        ({}, False),
        ({"TORCH_FR_BUFFER_SIZE": "0"}, False),
        ({"TORCH_FR_BUFFER_SIZE": "2000"}, True),
        ({"TORCH_NCCL_TRACE_BUFFER_SIZE": "20000"}, True),
        ({"TORCH_NCCL_TRACE_BUFFER_SIZE": "many"}, False),
    ],
)
def test_the_ranks_serve_their_flight_recorder_only_when_it_records(
    env: dict[str, str], on: bool
) -> None:
    assert flight_recorder_on(env) is on


def test_serve_is_a_no_op_outside_muster(monkeypatch: pytest.MonkeyPatch) -> None:
    assert flight.ENV == DIAG_DIR_ENV, "the agent and the rank read one name"
    monkeypatch.delenv(DIAG_DIR_ENV, raising=False)
    assert flight.serve() is False
    monkeypatch.setenv(DIAG_DIR_ENV, "/tmp/" + "x" * 120)
    monkeypatch.setenv("RANK", "0")
    assert flight.serve() is False, "a path too long for a Unix socket is refused, not raised"
    assert not os.path.exists("/tmp/" + "x" * 120)
