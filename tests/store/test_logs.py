"""Log lines on both engines: lossless bytes, poison lines set aside, following 1,200 ranks."""

from __future__ import annotations

import base64
import os
import random
import time
from collections.abc import Iterator

import pytest

from muster.errors import BadRequest
from muster.store import LogLineIn, LogLinesRejected, Store, open_store
from muster.store.models import LogLine
from tests.scheduler.workers import gang


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = open_store(db_url)
    yield s
    s.db.dispose()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def follow(store: Store, job_id: str, after: int, limit: int) -> tuple[list[LogLine], int]:
    """Page through ``logs_after`` as `muster logs -f` does; returns the lines and the cursor."""
    got: list[LogLine] = []
    while page := store.logs_after(job_id, after, limit=limit):
        got += page
        after = page[-1].ingest_id
    return got, after


def test_nul_and_bytes_that_are_not_utf8_come_back_exactly(store: Store) -> None:
    job = store.submit_job(gang(1)).id
    now = time.time()
    stored = store.append_logs(
        job,
        [
            ("rank", 0, 1, now, "stdout", "a\x00b"),  # NUL: PostgreSQL text refuses it
            ("rank", 0, 2, now, "stdout", "caf\ufffd", b64(b"caf\xe9")),  # as capture sends it
            ("rank", 0, 3, now, "stdout", "x\udcff"),  # a str from surrogateescape
            ("rank", 0, 4, now, "stdout", "plain é"),
            ("rank", 0, 5, now, "stdout", "\x00", b64(b"\x00\xff\x00")),
            LogLineIn("node", 0, 1, now, "stderr", "ok", b64(b"ok")),
        ],
    )
    assert stored == 6
    lines = store.logs(job)
    assert [ln.text for ln in lines] == [
        "a\x00b",
        "caf\ufffd",
        "x\ufffd",
        "plain é",
        "\x00\ufffd\x00",
    ]
    assert [ln.data for ln in lines] == [
        b"a\x00b",
        b"caf\xe9",
        b"x\xff",
        "plain é".encode(),
        b"\x00\xff\x00",
    ]
    assert [ln.raw_b64 for ln in lines] == [
        None,
        b64(b"caf\xe9"),
        b64(b"x\xff"),
        None,
        b64(b"\x00\xff\x00"),
    ]
    assert [ln.raw for ln in store.logs(job, origin="node")] == [None], "clean text needs no bytes"
    followed = [ln.data for ln in store.logs_after(job, 0) if ln.origin == "rank"]
    assert followed == [ln.data for ln in lines]


def test_one_bad_line_does_not_stop_later_batches(store: Store) -> None:
    """Once a job's batch failed on PostgreSQL, every later insert did too."""
    first, second = store.submit_job(gang(1)).id, store.submit_job(gang(1)).id
    now = time.time()
    store.append_logs_by_job(
        {
            first: [("rank", 0, 1, now, "stdout", "before\x00after")],
            second: [("rank", 0, 1, now, "stdout", "fine")],
        }
    )
    store.append_logs(second, [("rank", 0, 2, now, "stdout", "later")])
    assert [ln.text for ln in store.logs(second)] == ["fine", "later"]
    assert [ln.text for ln in store.logs(first)] == ["before\x00after"]


def test_a_malformed_batch_is_refused_naming_the_job(store: Store) -> None:
    job = store.submit_job(gang(1)).id
    now = time.time()
    good = ("rank", 0, 1, now, "stdout", "fine")
    for bad, words in [
        (("rank", 0, 2, now, "stdout"), "6 or 7 fields"),
        (("rank", -1, 2, now, "stdout", "x"), "rank -1"),
        (("rank", 2**31, 2, now, "stdout", "x"), "rank 2147483648"),
        (("rank", 0, 2, now, "weird-stream", "x"), "stream 'weird-stream'"),
        (("pod", 0, 2, now, "stdout", "x"), "origin 'pod'"),
        (("rank", 0, 2, float("nan"), "stdout", "x"), "time nan"),
        (("rank", 0, 2, now, "stdout", 42), "text is int"),
        (("rank", 0, 2, now, "stdout", "x", "not base64!"), "not base64"),
    ]:
        with pytest.raises(LogLinesRejected, match=words) as info:
            store.append_logs(job, [good, bad])
        assert job in str(info.value)
        assert "line 1" in str(info.value)
        assert isinstance(info.value, BadRequest)
        assert isinstance(info.value, ValueError), "callers catching ValueError still do"
    assert store.logs(job) == [], "all or nothing"


def test_salvaging_stores_what_it_can_and_returns_the_rest(store: Store) -> None:
    a, b = store.submit_job(gang(1)).id, store.submit_job(gang(1)).id
    now = time.time()
    result = store.append_logs_salvaging(
        {
            a: [
                ("rank", 0, 1, now, "stdout", "one"),
                ("rank", 0, 2, now, "stderr-but-long", "bad stream"),
                ("rank", 0, 3, now, "stdout", "three\x00"),
            ],
            b: [("rank", 0, 1, now, "stdout", "b one"), ["rank", 0]],
            "x" * 81: [("rank", 0, 1, now, "stdout", "no such job")],
        }
    )
    assert result.stored == 3
    assert [(r.job_id, r.line[:3]) for r in result.rejected] == [
        (a, ("rank", 0, 2)),
        (b, ["rank", 0]),
        ("x" * 81, ("rank", 0, 1)),
    ]
    assert "stream 'stderr-but-long'" in result.rejected[0].reason
    assert [ln.text for ln in store.logs(a)] == ["one", "three\x00"]
    assert [ln.text for ln in store.logs(b)] == ["b one"]
    events = [(e.job_id, e.kind, e.data) for e in store.events() if e.kind == "LogLinesRejected"]
    assert events == [(a, "LogLinesRejected", {"count": 1}), (b, "LogLinesRejected", {"count": 1})]
    again = store.append_logs_salvaging({a: [("rank", 0, 1, now, "stdout", "one")]})
    assert (again.stored, again.rejected) == (0, []), "a resent line is not new, not refused"


def test_following_1200_ranks_misses_and_repeats_nothing(store: Store) -> None:
    seed = int(os.environ.get("MUSTER_TEST_SEED", random.randrange(2**32)))
    print(f"MUSTER_TEST_SEED={seed}")
    rng = random.Random(seed)
    job = store.submit_job(gang(1)).id
    ranks, per_rank = 1200, 3
    now = time.time()
    lines = [
        ("rank", r, q, now + rng.random(), "stdout", f"r{r} q{q}")
        for r in range(ranks)
        for q in range(1, per_rank + 1)
    ]
    rng.shuffle(lines)
    half = len(lines) // 2
    store.append_logs(job, lines[:half])
    seen, cursor = follow(store, job, 0, limit=997)
    store.append_logs(job, lines[half:])
    store.append_logs(
        job,
        [("node", 0, 1, now, "stderr", "torchrun"), ("rank", 5000, 1, now, "stdout", "new rank")],
    )
    more, cursor = follow(store, job, cursor, limit=997)
    assert store.logs_after(job, cursor) == [], "caught up"
    keys = [(ln.origin, ln.rank, ln.seq) for ln in seen + more]
    assert len(keys) == len(set(keys)), "no line repeated"
    want = {(o, r, q) for o, r, q, *_ in lines} | {("node", 0, 1), ("rank", 5000, 1)}
    assert set(keys) == want, "no line missed, new ranks included"
    assert len(seen) == half
    nodes = store.logs_after(job, 0, ranks=[5000, 7], limit=10)
    assert {(ln.rank, ln.origin) for ln in nodes} == {(5000, "rank"), (7, "rank")}
    assert len(nodes) == per_rank + 1


def test_logs_after_refuses_the_old_per_rank_cursor(store: Store) -> None:
    job = store.submit_job(gang(1)).id
    with pytest.raises(TypeError, match="ingest_id"):
        store.logs_after(job, {"rank0": 3})  # type: ignore[arg-type]


def test_lines_the_database_refuses_are_found_and_the_rest_stored(store: Store) -> None:
    """Whatever a database refuses (here: a constraint a DBA added), ingest goes on."""
    with store.db.engine.begin() as conn:
        if store.db.dialect == "postgresql":
            conn.exec_driver_sql(
                "ALTER TABLE log_lines ADD CONSTRAINT no_poison CHECK (text <> 'poison')"
            )
        else:
            conn.exec_driver_sql(
                "CREATE TRIGGER no_poison BEFORE INSERT ON log_lines WHEN NEW.text = 'poison' "
                "BEGIN SELECT RAISE(ABORT, 'no_poison'); END"
            )
    a, b = store.submit_job(gang(1)).id, store.submit_job(gang(1)).id
    now = time.time()
    batch = [("rank", r, 1, now, "stdout", "poison" if r in (7, 30) else "ok") for r in range(50)]
    with pytest.raises(LogLinesRejected, match=a):
        store.append_logs(a, batch)
    result = store.append_logs_salvaging({a: batch, b: [("rank", 0, 1, now, "stdout", "fine")]})
    assert result.stored == 49
    assert sorted(r.line[1] for r in result.rejected) == [7, 30]
    assert all("no_poison" in r.reason for r in result.rejected)
    assert len(store.logs(a)) == 48
    assert [ln.text for ln in store.logs(b)] == ["fine"]
    events = [e.message for e in store.events(a) if e.kind == "LogLinesRejected"]
    assert len(events) == 1
    assert events[0].startswith("2 log line(s) could not be stored")


def test_pages_back_from_the_tail_and_filters_by_origin_and_rank_runs(store: Store) -> None:
    """The dashboard starts at the tail and scrolls up a page at a time: every line once,
    in order; a thousand ranks filter as runs, and a node's launcher lines alone."""
    job = store.submit_job(gang(1)).id
    now = time.time()
    lines = [("rank", r, s, now, "stdout", f"r{r} s{s}") for s in range(1, 4) for r in range(1200)]
    lines += [("node", 0, 1, now, "stderr", "torchrun 0"), ("node", 1, 1, now, "stderr", "tr 1")]
    store.append_logs(job, lines)
    pages: list[list[str]] = []
    before: int | None = None
    while page := store.logs_before(job, before, limit=1000):
        pages.append([ln.text for ln in page])
        before = page[0].ingest_id
    back = [text for page in reversed(pages) for text in page]
    assert back == [ln.text for ln in store.logs_after(job, 0, limit=10_000)]
    assert len(back) == len(lines)
    assert [ln.text for ln in store.logs_before(job, None, limit=2)] == back[-2:]
    many = store.logs_after(job, 0, ranks=[*range(1000), 1100], limit=10_000)
    assert {ln.rank for ln in many} == {*range(1000), 1100}
    assert {ln.origin for ln in many} == {"rank"}
    node1 = store.logs_before(job, None, ranks=[1], origin="node", limit=10)
    assert [(ln.origin, ln.text) for ln in node1] == [("node", "tr 1")]
    assert store.logs_after(job, 0, ranks=[], limit=10) == []
