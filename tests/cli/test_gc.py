"""`muster gc` as a user runs it (a real process), and the retention pass it shares with
`muster server --retention` (muster.controller.retention.collect), on a real SQLite store."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import update

from muster.controller.retention import collect, cutoff_for, plan_bundles, start_collecting
from muster.spec import JobState
from muster.store import Store, open_store
from muster.store.models import Job

DAY = 86_400
NOW = datetime.now(UTC)


def muster(*args: str | Path, data: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "muster", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin", "MUSTER_DATA_DIR": str(data)},
    )


@dataclass
class Site:
    """A controller's store and file store, with jobs in every situation retention meets."""

    store: Store
    db: Path
    root: Path
    jobs: dict[str, str]  # role -> job id
    bundles: dict[str, str]  # role -> sha256

    def artifact_dir(self, role: str) -> Path:
        return self.root / "artifacts" / self.jobs[role]

    def bundle(self, role: str) -> Path:
        return self.root / "bundles" / f"{self.bundles[role]}.tar.gz"


def make_bundle(root: Path, content: bytes, age_days: float) -> str:
    sha = hashlib.sha256(content).hexdigest()
    path = root / "bundles" / f"{sha}.tar.gz"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    then = time.time() - age_days * DAY
    os.utime(path, (then, then))
    return sha


def end_job(store: Store, job_id: str, state: JobState, days_ago: float) -> None:
    if state is JobState.SUCCEEDED:
        for step in (JobState.PLACING, JobState.RENDEZVOUS, JobState.RUNNING):
            store.set_job_state(job_id, step)
    store.set_job_state(job_id, state, "ended for the test")
    with store.db.transaction() as s:
        s.execute(
            update(Job).where(Job.id == job_id).values(finished_at=NOW - timedelta(days=days_ago))
        )


def run_job(store: Store, job_id: str) -> None:
    for step in (JobState.PLACING, JobState.RENDEZVOUS, JobState.RUNNING):
        store.set_job_state(job_id, step)


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    db, root = tmp_path / "muster.db", tmp_path / "files"
    store = open_store(str(db))
    bundles = {
        "old-only": make_bundle(root, b"code of the old job", 30),
        "shared": make_bundle(root, b"code the running job still uses", 30),
        "orphan-old": make_bundle(root, b"uploaded, never submitted", 30),
        "orphan-new": make_bundle(root, b"uploaded a minute ago", 0.0007),
    }
    spec = {"name": "train", "entrypoint": "train.py"}
    roles = {
        "old-succeeded": ("old-only", JobState.SUCCEEDED, 30),
        "old-failed": ("shared", JobState.FAILED, 20),
        "old-cancelled": (None, JobState.CANCELLED, 10),
        "recent": (None, JobState.SUCCEEDED, 1),
        "running": ("shared", None, 0),
        "queued": (None, None, 0),
    }
    jobs = {}
    for role, (bundle, state, days_ago) in roles.items():
        sha = bundles[bundle] if bundle else None
        job = store.submit_job(spec, bundle_sha256=sha)
        jobs[role] = job.id
        for node in (0, 1):
            out = root / "artifacts" / job.id / f"node{node}" / "model.pt"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(b"w" * 1000)
            store.add_artifact(job.id, node, "model.pt", 1000, "00" * 32)
        store.append_logs(job.id, [("rank", 0, seq, time.time(), "stdout", "x") for seq in (1, 2)])
        if role == "running":
            run_job(store, job.id)
        elif state is not None:
            end_job(store, job.id, state, days_ago)
    yield Site(store, db, root, jobs, bundles)
    store.db.dispose()


OLD = ("old-succeeded", "old-failed", "old-cancelled")
KEPT = ("recent", "running", "queued")


def test_gc_removes_what_old_ended_jobs_left_and_nothing_else(site: Site, tmp_path: Path) -> None:
    result = muster(
        "gc", "--older-than", "7d", "--db", site.db, "--artifacts", site.root, data=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "3 job(s) finished before" in result.stdout, result.stdout
    removed = "removed 6 artifact file(s) (5.9 KiB), 6 artifact row(s), 0 log line(s), 2 bundle(s)"
    assert removed in result.stdout, result.stdout
    for role in OLD:
        assert not site.artifact_dir(role).exists(), role
        assert site.store.artifacts(site.jobs[role]) == [], role
        assert len(site.store.logs(site.jobs[role])) == 2, "logs stay without --logs"
        assert site.store.job(site.jobs[role]).state != "queued"  # the job row stays
    for role in KEPT:
        assert (site.artifact_dir(role) / "node1" / "model.pt").is_file(), role
        assert len(site.store.artifacts(site.jobs[role])) == 2, role
    # The old job's own bundle and the old unsubmitted upload go; the bundle a running job
    # uses and a fresh upload stay.
    assert not site.bundle("old-only").exists()
    assert not site.bundle("orphan-old").exists()
    assert site.bundle("shared").is_file()
    assert site.bundle("orphan-new").is_file()
    assert f"bundle {site.bundles['old-only']}" in result.stdout


def test_gc_with_logs_deletes_the_old_jobs_log_lines(site: Site, tmp_path: Path) -> None:
    result = muster(
        "gc",
        "--logs",
        "--db",
        site.db,
        "--artifacts",
        site.root,
        "--older-than",
        "15d",
        data=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "2 job(s)" in result.stdout, result.stdout
    assert "4 log line(s)" in result.stdout, result.stdout
    assert site.store.logs(site.jobs["old-succeeded"]) == []
    assert site.store.logs(site.jobs["old-failed"]) == []
    for role in ("old-cancelled", *KEPT):  # cancelled 10 days ago: inside 15 days
        assert len(site.store.logs(site.jobs[role])) == 2, role
        assert site.artifact_dir(role).is_dir(), role


def test_gc_dry_run_removes_nothing(site: Site, tmp_path: Path) -> None:
    before = sorted(p.relative_to(site.root) for p in site.root.rglob("*"))
    result = muster(
        "gc", "--dry-run", "--logs", "--db", site.db, "--artifacts", site.root, data=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "would remove 6 artifact file(s)" in result.stdout, result.stdout
    assert "6 log line(s), 2 bundle(s)" in result.stdout, result.stdout
    assert sorted(p.relative_to(site.root) for p in site.root.rglob("*")) == before
    for role in (*OLD, *KEPT):
        assert len(site.store.artifacts(site.jobs[role])) == 2
        assert len(site.store.logs(site.jobs[role])) == 2


def test_gc_refuses_a_retention_it_cannot_read(site: Site, tmp_path: Path) -> None:
    result = muster("gc", "--older-than", "a week", "--db", site.db, data=tmp_path)
    assert result.returncode == 2
    assert "--older-than 'a week'" in result.stderr


def test_a_job_that_is_not_terminal_is_never_collected(site: Site) -> None:
    """Even with a cutoff in the future, so every job is 'older' than it."""
    report = collect(site.store, site.root, NOW + timedelta(days=1), logs=True)
    assert set(report.jobs) == {site.jobs[r] for r in (*OLD, "recent")}
    for role in ("running", "queued"):
        assert site.artifact_dir(role).is_dir()
        assert len(site.store.artifacts(site.jobs[role])) == 2
        assert len(site.store.logs(site.jobs[role])) == 2
    assert site.bundle("shared").is_file()
    # The rows of a job that is not terminal stay even when asked for by id.
    assert site.store.delete_artifacts([site.jobs["running"]]) == 0


def test_a_second_pass_finds_nothing_left(site: Site) -> None:
    first = collect(site.store, site.root, cutoff_for(timedelta(days=7)), logs=True)
    again = collect(site.store, site.root, cutoff_for(timedelta(days=7)), logs=True)
    assert (first.artifact_files, first.log_lines, len(first.bundles)) == (6, 6, 2)
    left = (again.artifact_files, again.artifact_rows, again.log_lines, again.bundles)
    assert left == (0, 0, 0, ())


@pytest.mark.parametrize(
    ("on_disk", "in_use", "expected"),
    [
        ({"a": 0.0, "b": 0.0}, {"a"}, ["b"]),  # b: used by no live job, old
        ({"a": 0.0}, set(), ["a"]),
        ({"a": 2e9}, set(), []),  # uploaded after the cutoff: a job may be about to use it
        ({}, {"a"}, []),
    ],
)
def test_plan_bundles(on_disk: dict[str, float], in_use: set[str], expected: list[str]) -> None:
    cutoff = datetime.fromtimestamp(1e9, UTC)
    assert plan_bundles(on_disk, in_use, cutoff) == expected


def test_the_server_timer_collects_at_once_and_stops(site: Site) -> None:
    stop = start_collecting(site.store, site.root, timedelta(days=7))
    try:
        deadline = time.monotonic() + 20
        while site.artifact_dir("old-succeeded").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not site.artifact_dir("old-succeeded").exists()
        assert site.artifact_dir("running").is_dir()
    finally:
        stop.set()


def test_server_refuses_a_retention_it_cannot_read(tmp_path: Path) -> None:
    result = muster("server", "--retention", "forever", data=tmp_path)
    assert result.returncode == 2
    assert "--retention 'forever'" in result.stderr
