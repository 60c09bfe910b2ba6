"""`muster demo`: the job is given as an argument or with --job; bad input names the fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def demo(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "muster", "demo", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=cwd,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"},
    )


def test_the_job_may_be_an_argument_and_a_missing_one_is_named(tmp_path: Path) -> None:
    gone = demo("nowhere/job.yaml", cwd=tmp_path)
    assert gone.returncode == 2
    assert "nowhere/job.yaml not found (the job file to run)" in gone.stderr
    (tmp_path / "jobs").mkdir()
    folder = demo("jobs", cwd=tmp_path)
    assert folder.returncode == 2
    assert "jobs is a directory, not a job file (the job file to run)" in folder.stderr
    default = demo(cwd=tmp_path)  # not in a checkout: the default job is not there
    assert default.returncode == 2
    assert "examples/ddp/job.yaml not found; run from the muster checkout or name a job" in (
        default.stderr
    )


def test_two_different_jobs_are_refused(tmp_path: Path) -> None:
    both = demo("a.yaml", "--job", "b.yaml", cwd=tmp_path)
    assert both.returncode == 2
    assert "two jobs given (a.yaml and --job b.yaml): give one" in both.stderr
