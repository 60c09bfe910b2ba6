"""Agent work-dir retention (muster.agent.retention) on a real directory tree."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from muster.agent.retention import remove_stale_job_dirs, stale_job_dirs

DAY = 86_400
WEEK = timedelta(days=7)


def make_job_dir(work_dir: Path, job: str, age_days: float, *, fresh_file: bool = False) -> Path:
    """``<work_dir>/<job>/node0/...`` with every entry ``age_days`` old (one fresh file)."""
    job_dir = work_dir / job
    files = [job_dir / "node0" / "src" / "train.py", job_dir / "node0" / "logs" / "rank0.log"]
    for path in files:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 100)
    then = time.time() - age_days * DAY
    for top, dirs, names in os.walk(job_dir, topdown=False):
        for name in [*names, *dirs]:
            os.utime(os.path.join(top, name), (then, then))
    os.utime(job_dir, (then, then))
    if fresh_file:
        os.utime(files[1])  # a rank still writing its log
    return job_dir


@pytest.fixture
def work_dir(tmp_path: Path) -> Path:
    work = tmp_path / "agents" / "w1"
    make_job_dir(work, "old-a1", 30)
    make_job_dir(work, "old-running-b2", 30)
    make_job_dir(work, "old-but-writing-c3", 30, fresh_file=True)
    make_job_dir(work, "recent-d4", 1)
    (work / ".agent-alive").write_text("")
    os.utime(work / ".agent-alive", (0, 0))
    (work / "stray-file").write_text("not a job dir")
    os.utime(work / "stray-file", (0, 0))
    return work


def test_removes_old_job_dirs_of_jobs_not_running_here(work_dir: Path) -> None:
    report = remove_stale_job_dirs(work_dir, WEEK, running={"old-running-b2"})
    assert report.removed == ("old-a1",)
    assert report.bytes == 200
    assert sorted(p.name for p in work_dir.iterdir()) == [
        ".agent-alive",
        "old-but-writing-c3",
        "old-running-b2",
        "recent-d4",
        "stray-file",
    ]


def test_a_running_job_keeps_its_dir_however_old(work_dir: Path) -> None:
    running = {"old-a1", "old-running-b2"}
    report = remove_stale_job_dirs(work_dir, timedelta(hours=12), running)
    assert report.removed == ("recent-d4",)
    assert (work_dir / "old-a1" / "node0" / "src" / "train.py").is_file()
    assert (work_dir / "old-running-b2").is_dir()


def test_a_file_written_lately_keeps_the_job_dir(work_dir: Path) -> None:
    """Age is the newest change anywhere under the job's dir, not the dir's own mtime."""
    remove_stale_job_dirs(work_dir, WEEK, running={"old-running-b2"})
    assert (work_dir / "old-but-writing-c3" / "node0" / "src" / "train.py").is_file()


def test_zero_retention_keeps_everything(work_dir: Path) -> None:
    assert stale_job_dirs(work_dir, timedelta(0), running=()) == []
    assert remove_stale_job_dirs(work_dir, timedelta(0)).removed == ()


def test_a_missing_work_dir_is_nothing_to_do(tmp_path: Path) -> None:
    assert remove_stale_job_dirs(tmp_path / "never-made", WEEK).removed == ()


def test_a_symlinked_job_dir_is_not_followed(work_dir: Path, tmp_path: Path) -> None:
    elsewhere = make_job_dir(tmp_path / "elsewhere", "precious", 30)
    (work_dir / "link-e5").symlink_to(elsewhere)
    remove_stale_job_dirs(work_dir, WEEK)
    assert (elsewhere / "node0" / "src" / "train.py").is_file()


def test_agent_refuses_a_retention_it_cannot_read(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "muster", "agent", "--retention", "soon"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"PATH": "/usr/bin:/bin", "MUSTER_DATA_DIR": str(tmp_path)},
    )
    assert result.returncode == 2
    assert "--retention 'soon'" in result.stderr
