"""The agent's capture seams: rank-file tailing, torchrun's root cause, log batching."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

import orjson
import pytest

from muster.agent.agent import BATCH_LINES, Agent, _Shipper
from muster.agent.capture import DISCOVER_EVERY_S, MAX_LINE, Line, RankTailer, root_cause
from muster.wire import Kind


def test_shipper_sends_every_line_once_in_order_whatever_the_backlog() -> None:
    shipper = _Shipper()
    total = 25 * BATCH_LINES + 17
    shipper.add("job", [("rank", 0, i + 1, 0.0, "stdout", f"line {i}") for i in range(total)])
    got: list[Line] = []
    while (taken := shipper.next()) is not None:
        batch, job, lines = taken
        assert job == "job"
        assert batch in shipper.unacked, "a batch counts as in flight only once it is taken"
        got += lines
        shipper.unacked.pop(batch)  # the controller acked it
    assert [ln[2] for ln in got] == list(range(1, total + 1))


def test_tailer_numbers_lines_per_rank_and_keeps_partial_lines(tmp_path: Path) -> None:
    base = tmp_path / "run_abc" / "attempt_0"
    for local in (0, 1):
        (base / str(local)).mkdir(parents=True)
    out0, err1 = base / "0" / "stdout.log", base / "1" / "stderr.log"
    lines: list[Line] = []
    tailer = RankTailer(tmp_path, first_rank=2, procs=2, emit=lines.extend)
    out0.write_text("a\nb\npart")
    err1.write_text("oops\n")
    tailer.poll()
    assert [(ln[1], ln[2], ln[4], ln[5]) for ln in lines] == [
        (2, 1, "stdout", "a"),
        (2, 2, "stdout", "b"),
        (3, 1, "stderr", "oops"),
    ]
    with out0.open("a") as fh:
        fh.write("ial\nlast-without-newline")
    tailer.poll()
    assert lines[-1][5] == "partial"
    tailer.poll(final=True)
    assert (lines[-1][1], lines[-1][2], lines[-1][5]) == (2, 4, "last-without-newline")


TORCHRUN_FAILURE = """
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-29_09:54:40
  host      : node-b
  rank      : 2 (local_rank: 0)
  exitcode  : -15 (pid: 7357)  (SIGTERM)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-29_09:54:40
  host      : node-b
  rank      : 3 (local_rank: 1)
  exitcode  : 1 (pid: 7358)
  error_file: <N/A>
============================================================
"""


def test_root_cause_is_read_from_torchruns_summary() -> None:
    assert root_cause(TORCHRUN_FAILURE.splitlines()) == (3, 1, None)
    killed = TORCHRUN_FAILURE.replace(
        "exitcode  : 1 (pid: 7358)", "exitcode  : -9 (pid: 7358)  (SIGKILL)"
    )
    assert root_cause(killed.splitlines()) == (3, -9, "SIGKILL")
    assert root_cause(["no summary here"]) == (None, None, None)


def test_tailer_keeps_every_byte_and_the_lines_stay_json(tmp_path: Path) -> None:
    """NUL and bytes that are not UTF-8 survive capture exactly; orjson still takes the lines."""
    out = tmp_path / "run" / "attempt_0" / "0" / "stdout.log"
    out.parent.mkdir(parents=True)
    lines: list[Line] = []
    tailer = RankTailer(tmp_path, first_rank=0, procs=1, emit=lines.extend)
    written = [b"a\x00b", b"caf\xe9 \xff\xfe", "plain é".encode(), b"\r", b""]
    out.write_bytes(b"\n".join(written) + b"\n")
    tailer.poll()
    wire = orjson.loads(orjson.dumps(lines))
    assert [ln[5] for ln in wire] == ["a\x00b", "caf\ufffd \ufffd\ufffd", "plain é", "", ""]
    assert [_bytes(ln) for ln in wire] == [
        b"a\x00b",
        b"caf\xe9 \xff\xfe",
        "plain é".encode(),
        b"",
        b"",
    ]
    assert [len(ln) for ln in wire] == [6, 7, 6, 6, 6], "only a line that is not UTF-8 has raw"


def test_long_lines_are_cut_between_characters(tmp_path: Path) -> None:
    out = tmp_path / "run" / "attempt_0" / "0" / "stderr.log"
    out.parent.mkdir(parents=True)
    lines: list[Line] = []
    tailer = RankTailer(tmp_path, first_rank=0, procs=1, emit=lines.extend)
    long = ("é" * MAX_LINE).encode()  # 2 bytes a character: a cut at MAX_LINE bytes would
    out.write_bytes(b"x" + long + b"\n")  # fall inside one, after the leading "x"
    tailer.poll()
    assert all(len(ln) == 6 for ln in lines), "every piece is whole UTF-8"
    assert "".join(ln[5] for ln in lines).encode() == b"x" + long
    assert all(len(ln[5].encode()) <= MAX_LINE for ln in lines)
    assert [ln[2] for ln in lines] == list(range(1, len(lines) + 1))


def _bytes(line: list[object]) -> bytes:
    if len(line) == 7:
        return base64.b64decode(str(line[6]))
    return str(line[5]).encode()


def test_the_pids_of_torchruns_failure_summary() -> None:
    from muster.agent.capture import failed_pids

    lines = [
        "[2026-11-30 12:00:00] torch.distributed.elastic.multiprocessing.api: failed",
        "Root Cause (first observed failure):",
        "[0]:",
        "  rank      : 3 (local_rank: 1)",
        "  exitcode  : -9 (pid: 11795)",
        "  traceback : Signal 9 (SIGKILL) received by PID 11795",
    ]
    assert failed_pids(lines) == {11795}
    assert failed_pids(["no summary"]) == set()


def test_a_restarts_new_attempt_is_followed_and_nothing_of_it_is_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once every rank's files are found the tailer looks for new ones only now and then
    (a torchrun restart writes attempt_1): the new attempt's lines all arrive at the next
    look, and at the final read whatever the clock says."""
    clock = [1000.0]
    monkeypatch.setattr("muster.agent.capture.time.monotonic", lambda: clock[0])
    first = tmp_path / "run" / "attempt_0" / "0"
    first.mkdir(parents=True)
    (first / "stdout.log").write_text("one\n")
    (first / "stderr.log").write_text("")
    lines: list[Line] = []
    tailer = RankTailer(tmp_path, first_rank=0, procs=1, emit=lines.extend)
    tailer.poll()
    second = tmp_path / "run" / "attempt_1" / "0"
    second.mkdir(parents=True)
    (second / "stdout.log").write_text("two\nthree\n")
    (second / "stderr.log").write_text("")
    tailer.poll()  # within DISCOVER_EVERY_S of the last look: not found yet
    assert [ln[5] for ln in lines] == ["one"]
    clock[0] += DISCOVER_EVERY_S
    tailer.poll()
    assert [(ln[2], ln[5]) for ln in lines] == [(1, "one"), (2, "two"), (3, "three")]
    third = tmp_path / "run" / "attempt_2" / "0"
    third.mkdir(parents=True)
    (third / "stdout.log").write_text("four\n")
    tailer.poll(final=True)  # the member is over: every file is read, found or not
    assert [ln[5] for ln in lines][-1] == "four"


def test_the_log_flush_wakes_for_lines_and_a_new_link_sends_what_waited() -> None:
    """The flush sleeps until lines come (no clock); a link that broke mid-flush leaves
    lines waiting, and the next link's flush sends them without new lines to wake it."""

    async def flushes() -> list[list[int]]:
        agent = Agent.__new__(Agent)  # only the flush's parts: the shipper and a link
        agent.shipper, agent._acked = _Shipper(), asyncio.Event()
        sent: list[list[int]] = []
        stuck = asyncio.Event()

        async def send(kind: Kind, body: dict[str, Any]) -> bool:
            sent.append([line[2] for line in body["lines"]])
            if len(sent) == 2:  # the link breaks while this batch is being sent
                stuck.set()
                await asyncio.Event().wait()
            return True

        agent.send = send  # type: ignore[method-assign]
        first = asyncio.create_task(agent._flush_logs())
        await asyncio.sleep(0.2)
        assert sent == [], "no lines: nothing sent, nothing polled"
        agent.shipper.add("job", [("rank", 0, 1, 0.0, "stdout", "one")])
        for _ in range(100):
            if sent:
                break
            await asyncio.sleep(0.01)
        assert sent == [[1]]
        many = [("rank", 0, i, 0.0, "stdout", "x") for i in range(2, 2 + 2 * BATCH_LINES)]
        agent.shipper.add("job", many)  # two batches: the link breaks in the first
        await asyncio.wait_for(stuck.wait(), 5)
        first.cancel()
        agent.send = lambda kind, body: send_ok(sent, body)  # type: ignore[method-assign]
        second = asyncio.create_task(agent._flush_logs())  # the next link's flush
        for _ in range(100):
            if len(sent) == 3:
                break
            await asyncio.sleep(0.01)
        second.cancel()
        return sent

    sent = asyncio.run(flushes())
    assert len(sent) == 3, "the batch left waiting went out on the next link"
    assert sent[2] == list(range(2 + BATCH_LINES, 2 + 2 * BATCH_LINES))


async def send_ok(sent: list[list[int]], body: dict[str, Any]) -> bool:
    sent.append([line[2] for line in body["lines"]])
    return True
