"""`muster validate` and `muster plan` as a user runs them: a real process, exit codes, output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_JOB = ROOT / "examples/plan/job.yaml"
EXAMPLE_POOL = ROOT / "examples/plan/workers.yaml"


def muster(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "muster", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"},
    )


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_validate_prints_every_nodes_command() -> None:
    result = muster("validate", EXAMPLE_JOB)
    assert result.returncode == 0, result.stderr
    assert "world size 8, backend nccl, device cuda" in result.stdout
    for node in (0, 1):
        assert (
            f"python -m torch.distributed.run --nnodes 2 --nproc-per-node 4 --node-rank {node} "
            "--master-addr NODE0_ADDR --master-port PORT --max-restarts=0 -m train.finetune "
            "--epochs 3"
        ) in result.stdout
    assert "node1 (ranks 4-7)" in result.stdout


def test_validate_refuses_with_fields_and_exit_2(tmp_path: Path) -> None:
    job = write(
        tmp_path,
        "bad.yaml",
        """
name: Bad_Name
entrypoint: train.py
retries: 1
env: {WORLD_SIZE: "8"}
distributed: {num_workers: 2, backend: nccl}
""",
    )
    result = muster("validate", job)
    assert result.returncode == 2
    for field in ("name:", "env.WORLD_SIZE:", "distributed.backend:", "retries:"):
        assert field in result.stderr, result.stderr
    assert result.stdout == ""


def test_validate_unknown_field_suggests(tmp_path: Path) -> None:
    job = write(tmp_path, "typo.yaml", "name: a\nentrypoint: t.py\ndistributed: {num_worker: 2}\n")
    result = muster("validate", job)
    assert result.returncode == 2
    assert "distributed.num_worker: unknown field; did you mean 'num_workers'?" in result.stderr


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (None, "cannot read"),
        ("name: [unclosed\n", "not valid YAML at line"),
        ("- just\n- a list\n", "must be a mapping"),
    ],
)
def test_validate_unreadable_input(tmp_path: Path, content: str | None, words: str) -> None:
    path = tmp_path / "job.yaml"
    if content is not None:
        path.write_text(content)
    result = muster("validate", path)
    assert result.returncode == 2
    assert words in result.stderr


def test_plan_places_the_example() -> None:
    result = muster("plan", EXAMPLE_JOB, "--workers", EXAMPLE_POOL)
    assert result.returncode == 0, result.stderr
    assert "placed on the direct path" in result.stdout
    assert "100.64.0.1" in result.stdout
    assert "muster0" in result.stdout
    assert "--master-addr 100.64.0.1" in result.stdout
    assert "aws-c" not in result.stdout, "the torch 2.4.0 worker is never mixed in"


def test_plan_says_why_pending(tmp_path: Path) -> None:
    job = write(
        tmp_path, "big.yaml", EXAMPLE_JOB.read_text().replace("num_workers: 2", "num_workers: 4")
    )
    result = muster("plan", job, "--workers", EXAMPLE_POOL)
    assert result.returncode == 1
    assert "unplaceable: needs 4 idle workers" in result.stdout
    assert "container-only" in result.stdout


def test_plan_bad_inventory(tmp_path: Path) -> None:
    pool = write(
        tmp_path,
        "pool.yaml",
        "workers:\n  - id: a\n    hostname: a\n    gpu: 3\n  - id: a\n    hostname: b\n",
    )
    result = muster("plan", EXAMPLE_JOB, "--workers", pool)
    assert result.returncode == 2
    assert "workers[0].gpu: unknown field; did you mean 'gpus'?" in result.stderr
    assert "workers[1].id: 'a' appears twice" in result.stderr
