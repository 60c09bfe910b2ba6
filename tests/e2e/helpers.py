"""Jobs and waits for the end-to-end tests: real controller, agents, torchrun, gloo."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import psutil
import yaml

from muster.cli.local import LocalCluster
from muster.client import Client
from muster.spec import parse_job

TERMINAL = {"succeeded", "failed", "cancelled"}


def write_job(root: Path, name: str, script: str, **spec: Any) -> Path:
    """A job directory with train.py and job.yaml (2 nodes x 2 procs on gloo by default)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "train.py").write_text(script)
    data = {
        "name": name,
        "entrypoint": "train.py",
        "distributed": {"num_workers": 2, "procs_per_worker": 2, "backend": "gloo"},
        **spec,
    }
    (root / "job.yaml").write_text(yaml.safe_dump(data))
    return root / "job.yaml"


def submit(api: Client, job_file: Path) -> str:
    spec = parse_job(yaml.safe_load(job_file.read_text()))
    return str(api.submit_with_bundle(spec, job_file.parent)["id"])


def wait_state(
    api: Client, job_id: str, states: set[str] = TERMINAL, timeout: float = 120
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = api.job(job_id)
        if job["state"] in states:
            return job
        time.sleep(0.2)
    raise AssertionError(f"{job_id} still {api.job(job_id)['state']} after {timeout}s")


def all_lines(api: Client, job_id: str) -> list[dict[str, Any]]:
    lines: list[dict[str, Any]] = []
    cursor = ""
    while True:
        page = api.logs(job_id, after=cursor, limit=50_000)
        lines += page["lines"]
        cursor = page["next"]
        if not page["lines"]:
            return lines


def job_processes(cluster: LocalCluster, job_id: str) -> list[psutil.Process]:
    """Processes running out of this job's run directories (its ranks and torchruns)."""
    found = []
    for proc in psutil.process_iter(["cwd", "cmdline"]):
        try:
            cwd = proc.info["cwd"] or ""
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if str(cluster.data_dir) in cwd and f"/{job_id}/" in cwd + "/":
            found.append(proc)
    return found


def wait_no_processes(cluster: LocalCluster, job_id: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not job_processes(cluster, job_id):
            return
        time.sleep(0.2)
    left = [" ".join(p.cmdline()) for p in job_processes(cluster, job_id)]
    raise AssertionError(f"processes of {job_id} left after {timeout}s: {left}")


def event_kinds(job: dict[str, Any]) -> list[str]:
    return [e["kind"] for e in job["events"]]
