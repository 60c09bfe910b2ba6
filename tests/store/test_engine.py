"""Opening the database: reads never wait for a writer, files muster creates are private."""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from muster.errors import StoreUnavailable
from muster.spec import JobState
from muster.store import Store, open_store
from muster.store.engine import SQLITE_BUSY_TIMEOUT_MS, ensure_data_dir
from tests.scheduler.workers import gang, worker
from tests.store.locks import held_write_lock


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[tuple[Store, str]]:
    path = str(tmp_path / "muster.db")
    store = open_store(path)
    yield store, path
    store.db.dispose()


def _within(seconds: float, call: Callable[[], Any]) -> Any:
    """Run ``call`` in a thread; fail unless it returns within ``seconds``."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"a read waited more than {seconds} s for the writer"
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_sqlite_reads_do_not_wait_for_a_writer(sqlite_store: tuple[Store, str]) -> None:
    store, path = sqlite_store
    store.upsert_worker(worker("w00"))
    job = store.submit_job(gang(1))
    store.append_logs(job.id, [("rank", 0, 1, time.time(), "stdout", "hello")])
    store.put_setting("token", "t")
    reads: list[Callable[[], Any]] = [
        lambda: store.job(job.id).state,
        lambda: [j.id for j in store.jobs([JobState.QUEUED])],
        store.job_counts,
        lambda: store.members(job.id),
        lambda: len(store.events(job.id)),
        lambda: store.conditions(job.id),
        lambda: [ln.text for ln in store.logs(job.id)],
        lambda: [ln.text for ln in store.logs_after(job.id, 0)],
        lambda: store.artifacts(job.id),
        lambda: len(store.workers()),
        lambda: len(store.worker_rows()),
        lambda: store.get_setting("token"),
        lambda: store.setting("token", lambda: "other"),
    ]
    assert SQLITE_BUSY_TIMEOUT_MS >= 5000
    with held_write_lock(path):
        t0 = time.monotonic()
        got = [_within(4.0, read) for read in reads]
        elapsed = time.monotonic() - t0
    assert got[0] == "queued"
    assert got[6] == got[7] == ["hello"]
    assert got[11] == got[12] == "t"
    # A read that waited for the lock would wait the busy timeout (5 s) each: 13 of them
    # well over a minute. The bound leaves room for a loaded machine, not for that.
    assert elapsed < 15.0, f"{len(reads)} reads took {elapsed:.2f} s beside a writer"


def test_writes_still_wait_for_the_writer(sqlite_store: tuple[Store, str]) -> None:
    """A read-only transaction is only for reads: writes queue behind the lock as before."""
    store, path = sqlite_store
    done = threading.Event()

    def write() -> None:
        store.put_setting("k", "v")
        done.set()

    with held_write_lock(path):
        thread = threading.Thread(target=write, daemon=True)
        thread.start()
        assert not done.wait(0.5), "a write went through while another writer held the lock"
    thread.join(10)
    assert store.get_setting("k") == "v"


def test_a_writer_starts_as_soon_as_the_last_one_commits(
    sqlite_store: tuple[Store, str],
) -> None:
    """Writers of one process queue for each other instead of SQLite's busy handler, which
    polls with sleeps of up to 100 ms: a write that arrives while another transaction is
    open gets SQLite's lock right after that one commits, not at the handler's next poll."""
    store, _path = sqlite_store
    began: dict[int, float] = {}  # thread -> when its transaction got SQLite's lock
    # (after the engine's own "begin" listener, which runs BEGIN IMMEDIATE)
    event.listen(
        store.db.engine,
        "begin",
        lambda _c: began.__setitem__(threading.get_ident(), time.monotonic()),
    )
    lags: list[float] = []
    for _ in range(3):
        opened = threading.Event()
        committed: list[float] = []

        def hold(opened: threading.Event = opened, committed: list[float] = committed) -> None:
            with store.db.transaction() as session:
                session.connection().exec_driver_sql(
                    "INSERT OR REPLACE INTO settings (key, value) VALUES ('held', 'x')"
                )
                opened.set()
                time.sleep(0.45)  # past the busy handler's 1+2+...+50 ms (228 ms) ramp
            committed.append(time.monotonic())

        holder = threading.Thread(target=hold, daemon=True)
        holder.start()
        assert opened.wait(10)
        store.put_setting("k", "v")  # waits for the holder's commit
        holder.join(10)
        lags.append(began[threading.get_ident()] - committed[0])
    assert store.get_setting("k") == "v"
    # Through the busy handler the write got the lock at its next 100 ms poll: ~80 ms
    # late here (its tries at 428 and 528 ms). Queued, it starts at once.
    assert min(lags) < 0.03, f"the waiting write started {min(lags) * 1e3:.0f} ms late"


def test_a_writer_queued_too_long_fails_with_a_clear_error(
    sqlite_store: tuple[Store, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The queue of writers is bounded as SQLite's busy timeout is: a write that waits that
    long for another writer of this process fails, saying so, and nothing is written."""
    store, _path = sqlite_store
    monkeypatch.setattr("muster.store.engine.SQLITE_BUSY_TIMEOUT_MS", 200)
    opened, release = threading.Event(), threading.Event()

    def hold() -> None:
        with store.db.transaction():
            opened.set()
            release.wait(10)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert opened.wait(10)
    t0 = time.monotonic()
    try:
        with pytest.raises(StoreUnavailable, match="another writer"):
            store.put_setting("k", "v")
    finally:
        release.set()
        holder.join(10)
    assert time.monotonic() - t0 < 5
    assert store.get_setting("k") is None
    store.put_setting("k", "v")  # and the next write, once it is free, goes through
    assert store.get_setting("k") == "v"


def test_a_new_data_dir_and_database_are_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = os.umask(0o022)
    try:
        data = tmp_path / "home" / "muster"
        monkeypatch.setenv("MUSTER_DATA_DIR", str(data))
        store = open_store()
        try:
            store.submit_job(gang(1))  # the -wal and -shm files exist while a connection is open
            files = {p.name: stat.S_IMODE(p.stat().st_mode) for p in data.iterdir()}
            assert stat.S_IMODE(data.stat().st_mode) == 0o700
            assert files == {"muster.db": 0o600, "muster.db-wal": 0o600, "muster.db-shm": 0o600}
        finally:
            store.db.dispose()
        assert ensure_data_dir() == data
    finally:
        os.umask(old)


def test_an_existing_directory_keeps_its_mode(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    open_store(str(shared / "muster.db")).db.dispose()
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755, "not muster's to tighten"
    assert stat.S_IMODE((shared / "muster.db").stat().st_mode) == 0o600


def test_ensure_data_dir_creates_it_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MUSTER_DATA_DIR", str(tmp_path / "a" / "b"))
    path = ensure_data_dir()
    assert path == tmp_path / "a" / "b"
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
