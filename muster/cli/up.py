"""``muster up muster.cluster.yml``: the cluster file's workers and join window.

``--dry-run`` validates the file and prints the window, every host with its ranks and the
ssh command ``muster up`` reaches it by, without connecting anywhere.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import typer
from rich.table import Table

from muster.cli.main import app, err, out, reports_errors
from muster.errors import UserError
from muster.spec import load_cluster_file
from muster.spec.cluster import ClusterFile, Worker

LOOPBACK = ("127.", "::1", "localhost")


def ssh_argv(worker: Worker) -> list[str]:
    """The OpenSSH client's argv for ``worker``: never a password prompt, and a forward that
    cannot be set up ends the session instead of running without it."""
    ssh = worker.ssh
    argv = ["ssh", "-o", "BatchMode=yes", "-o", "ExitOnForwardFailure=yes", "-p", str(ssh.port)]
    if ssh.identity_file:
        argv += ["-i", str(Path(ssh.identity_file).expanduser())]
    for option in ssh.options:
        argv += ["-o", option]
    target = ssh.target or worker.host
    argv.append(f"{ssh.user}@{target}" if ssh.user else target)
    return argv


def describe(cluster: ClusterFile) -> None:
    ctl, join = cluster.controller, cluster.controller.join
    capacity = cluster.capacity
    out.print(f"[green]valid[/] controller {ctl.host}:{ctl.port}, {len(cluster.workers)} worker(s)")
    ranks = f"{capacity}" if capacity is not None else "probed at dispatch (devices: all)"
    quorum = cluster.quorum() or "every configured rank"
    target = cluster.target() if join.start != "manual" else "none (manual)"
    out.print(
        f"window: start {join.start}, quorum {quorum}, target {target or 'every configured rank'}, "
        f"join_timeout {join.join_timeout}s, max_join_timeout {join.max_join_timeout}s; "
        f"configured ranks {ranks}"
    )
    if join.open_admission and not ctl.host.startswith(LOOPBACK):
        err.print(
            f"[yellow]warning:[/] open_admission on {ctl.host}: any peer that reaches this port "
            "can join (and so influence) the run; use it only on a fully trusted network"
        )
    table = Table(box=None, pad_edge=False)
    for column in ("HOST", "RANKS", "DEVICES", "INTERFACE", "PATH", "DATA"):
        table.add_column(column)
    first: int | None = 0
    for worker in cluster.workers:
        count = worker.ranks
        if first is not None and count is not None:
            span = f"{first}-{first + count - 1}" if count > 1 else str(first)
            first += count
        else:
            span, first = "?", None
        devices = (
            "cpu x" + str(worker.procs)
            if worker.procs is not None
            else ",".join(map(str, worker.devices))
            if isinstance(worker.devices, list)
            else "all"
        )
        table.add_row(
            worker.host,
            span,
            devices,
            worker.interface or "-",
            worker.path or "-",
            worker.data_path or "-",
        )
    out.print(table)
    for worker in cluster.workers:
        out.print(f"{worker.host}: {shlex.join(ssh_argv(worker))}", markup=False)
    out.print("ranks are given in the order hosts are admitted; the table shows worker order")


@app.command()
@reports_errors
def up(
    cluster_file: Path = typer.Argument(..., help="the cluster file (muster.cluster.yml)"),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="validate and print hosts, ranks and ssh targets; connect nowhere"
    ),
) -> None:
    """Start the cluster file's workers over SSH and open the join window."""
    cluster = load_cluster_file(cluster_file)
    describe(cluster)
    if not dry_run:
        raise UserError(
            "starting agents over SSH is not available yet in this version: the file above is "
            "valid; run `muster agent` on each host (or `muster up --dry-run` to check a file)"
        )
