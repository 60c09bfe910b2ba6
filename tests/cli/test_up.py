"""`muster up --dry-run` as a user runs it: a real process, exit codes, output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples/cluster/muster.cluster.yml"


def muster(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "muster", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin", "HOME": "/home/someone"},
    )


def test_dry_run_prints_the_window_hosts_ranks_and_ssh_targets() -> None:
    result = muster("up", "--dry-run", EXAMPLE)
    assert result.returncode == 0, result.stderr
    assert "valid controller 127.0.0.1:7070, 2 worker(s)" in result.stdout
    assert "window: start auto" in result.stdout
    assert "join_timeout 300s, max_join_timeout 900s" in result.stdout
    lines = result.stdout.splitlines()
    assert any(line.split()[:3] == ["node-a", "0-1", "0,1"] for line in lines if line.strip())
    assert any(line.split()[:3] == ["node-b", "?", "all"] for line in lines if line.strip())
    assert (
        "node-b: ssh -o BatchMode=yes -o ExitOnForwardFailure=yes -p 2222 -i "
        "/home/someone/.ssh/cluster_key -o ProxyJump=bastion -- ubuntu@10.0.0.12" in result.stdout
    )


def test_a_bad_file_exits_2_naming_every_key(tmp_path: Path) -> None:
    bad = tmp_path / "muster.cluster.yml"
    bad.write_text(
        "controller: {join: {start: manual, target_ranks: 3}}\n"
        "workers:\n  - {host: a, procs: 1}\n  - {host: b, procs: 1, env: {RANK: '1'}}\n"
    )
    result = muster("up", "--dry-run", bad)
    assert result.returncode == 2
    for key in ("controller.join.target_ranks", "workers[0].interface", "workers[1].env.RANK"):
        assert key in result.stderr


def test_open_admission_warns_loudly_whatever_the_bind(tmp_path: Path) -> None:
    loud = tmp_path / "muster.cluster.yml"
    loud.write_text(
        "controller: {host: 0.0.0.0, join: {open_admission: true}}\n"
        "workers: [{host: a, procs: 2}]\n"
    )
    result = muster("up", "--dry-run", loud)
    assert result.returncode == 0, result.stderr
    assert "warning: open_admission on 0.0.0.0: any peer that reaches this port" in result.stderr
    local = tmp_path / "local.yml"  # loopback: every user of the machine reaches it
    local.write_text("controller: {join: {open_admission: true}}\nworkers: [{host: a, procs: 2}]\n")
    assert "any user of this machine" in muster("up", "--dry-run", local).stderr
    quiet = tmp_path / "quiet.yml"
    quiet.write_text("controller: {host: 0.0.0.0}\nworkers: [{host: a, procs: 2}]\n")
    assert "warning" not in muster("up", "--dry-run", quiet).stderr


def test_a_workers_provider_and_region_go_to_its_walk_in() -> None:
    from muster.cli.fanout import remote_command
    from muster.spec.cluster import Worker

    worker = Worker(host="a", procs=1, provider="aws", region="us-east-1", region_class="us")
    line = remote_command(worker, "j1", 7070)
    assert "--provider aws --region us-east-1 --region-class us" in line, line
    assert "--region" not in remote_command(Worker(host="b", procs=1), "j1", 7070)


def test_a_malformed_region_in_the_cluster_file_names_its_key(tmp_path: Path) -> None:
    bad = tmp_path / "muster.cluster.yml"
    bad.write_text("workers:\n  - {host: a, procs: 1, region: 'us east'}\n")
    result = muster("up", "--dry-run", bad)
    assert result.returncode == 2
    assert "workers[0].region" in result.stderr, result.stderr
