"""`muster demo`: the job is given as an argument or with --job; bad input names the fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from muster.cli.demo import default_job

ROOT = Path(__file__).resolve().parents[2]


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


def test_the_default_job_is_found_from_any_directory_of_an_editable_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert default_job() == ROOT / "examples/ddp/job.yaml"
    (tmp_path / "examples/ddp").mkdir(parents=True)
    (tmp_path / "examples/ddp/job.yaml").write_text("name: mine\nentrypoint: t.py\n")
    assert default_job() == Path("examples/ddp/job.yaml"), "the current directory's first"


def test_two_different_jobs_are_refused(tmp_path: Path) -> None:
    both = demo("a.yaml", "--job", "b.yaml", cwd=tmp_path)
    assert both.returncode == 2
    assert "two jobs given (a.yaml and --job b.yaml): give one" in both.stderr
