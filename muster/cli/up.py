"""``muster up muster.cluster.yml JOB.yaml``: run a job on the cluster file's workers.

The job goes in as a window job sized to the workers (quorum and target: every configured
rank, unless ``controller.join`` says otherwise), one walk-in per worker is started over SSH
(muster.cli.fanout), and the job's lines are followed until it ends; the exit code is the
job's verdict. ``--dry-run`` validates the file (and the job) and prints the window, every
host with its ranks and the ssh command that reaches it, without connecting anywhere.
"""

from __future__ import annotations

import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import typer
from rich.table import Table

from muster.cli.common import ControllerOpt, TokenFileOpt, client, read_secret
from muster.cli.fanout import Session, capacity, ssh_argv, start_session, stop_sessions, watch
from muster.cli.follow import follow_logs
from muster.cli.main import app, err, out, reports_errors
from muster.client import Client, controller_url
from muster.errors import MusterError, UserError
from muster.spec import JobSpec, load_cluster_file, load_job_file, parse_job
from muster.spec.cluster import ClusterFile

LOOPBACK = ("127.", "::1", "localhost")


def describe(cluster: ClusterFile) -> None:
    ctl, join = cluster.controller, cluster.controller.join
    total = cluster.capacity
    out.print(f"[green]valid[/] controller {ctl.host}:{ctl.port}, {len(cluster.workers)} worker(s)")
    ranks = f"{total}" if total is not None else "probed at dispatch (devices: all)"
    quorum = cluster.quorum() or "every configured rank"
    target = cluster.target() if join.start != "manual" else "none (manual)"
    out.print(
        f"window: start {join.start}, quorum {quorum}, target {target or 'every configured rank'}, "
        f"join_timeout {join.join_timeout}s, max_join_timeout {join.max_join_timeout}s; "
        f"configured ranks {ranks}"
    )
    if join.open_admission:
        reach = (
            "any user of this machine (and any ssh tunnel to it)"
            if ctl.host.startswith(LOOPBACK)
            else "any peer that reaches this port"
        )
        err.print(
            f"[yellow]warning:[/] open_admission on {ctl.host}: {reach} can walk in without "
            "the join string (muster join --open-admission) and join, and so influence, the "
            "run; use it only on a network you trust entirely"
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


def window_spec(spec: JobSpec, cluster: ClusterFile, total: int) -> JobSpec:
    """The job as a window job on these workers: the window's settings from the cluster
    file, quorum and target from the (probed) capacity, the cluster's env under the job's."""
    join = cluster.controller.join
    data: dict[str, Any] = spec.model_dump(mode="json", exclude_none=True)
    dist = data.get("distributed") or {}
    window = join.model_dump(mode="json", exclude_none=True)
    window["named_only"] = True  # its boxes, not a fleet waiting for any run
    window["quorum"] = cluster.quorum(total)
    if join.start != "manual":
        window["target_ranks"] = cluster.target(total)
    dist.update(
        num_workers=len(cluster.workers),
        procs_per_worker=1,
        membership="window",
        window=window,
    )
    dist.pop("node_procs", None)
    data["distributed"] = dist
    data["env"] = {**cluster.env, **spec.env}
    return parse_job(data, source="the job on this cluster")


def _host_left(api: Client, job: str, session: Session) -> None:
    """A worker's session ended: before its world formed, the run cannot form as configured
    (the job is cancelled, with that host's last words); after, fail-fast has it."""
    try:
        if api.job(job)["state"] != "queued":
            return
        tail = " ".join(session.log.read_text(errors="replace").split())[-300:]
        err.print(f"[{session.worker.host}] left before the world formed: {tail}", markup=False)
        api.cancel(job)
    except MusterError as exc:  # the controller is going away too: follow_logs will say so
        err.print(f"[{session.worker.host}] left; cancelling {job} failed: {exc}", markup=False)


@app.command()
@reports_errors
def up(
    cluster_file: Path = typer.Argument(..., help="the cluster file (muster.cluster.yml)"),
    job_file: Path = typer.Argument(None, help="the job to run on its workers"),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="validate and print hosts, ranks and ssh targets; connect nowhere"
    ),
    controller: str = ControllerOpt,
    token_file: Path | None = TokenFileOpt,
    join_token_file: Path = typer.Option(
        None,
        "--join-token-file",
        help="file (mode 0600) holding the join string `muster token` prints, handed to each "
        "worker over its ssh session [or set MUSTER_TOKEN]",
    ),
) -> None:
    """Run a job on the cluster file's workers: one walk-in per worker over SSH, dialling
    back through a reverse forward; follows the job's lines until it ends."""
    cluster = load_cluster_file(cluster_file)
    spec = load_job_file(job_file) if job_file is not None else None
    describe(cluster)
    for worker in cluster.workers:
        if any(
            o.replace(" ", "").lower() == "stricthostkeychecking=no" for o in worker.ssh.options
        ):
            err.print(
                f"[yellow]warning:[/] {worker.host}: StrictHostKeyChecking=no: the join secret "
                "goes down this session, and an unchecked host key lets a man in the middle "
                "take it; add the host's key to known_hosts instead"
            )
    if dry_run:
        return
    if spec is None or job_file is None:
        raise UserError("name the job to run: muster up CLUSTER_FILE JOB.yaml")
    if not cluster.workers:
        raise UserError(f"{cluster_file}: no workers to start; list them under workers:")
    join = read_secret(join_token_file, "MUSTER_TOKEN", "the join string")
    if join is None:
        raise UserError(
            "no join string for the workers: pass --join-token-file (what `muster token` "
            "prints on the controller, chmod 600) or set MUSTER_TOKEN"
        )
    ctl = cluster.controller
    host = "127.0.0.1" if ctl.host in ("0.0.0.0", "::") else ctl.host
    url = urlparse(controller_url(controller or f"http://{host}:{ctl.port}"))
    api = client(controller or url.geturl(), token_file)
    total, _ranks = capacity(cluster)  # devices: all -> nvidia-smi over ssh, now
    world = window_spec(spec, cluster, total)
    job = api.submit_with_bundle(world, (job_file.parent / world.workdir).resolve())["id"]
    err.print(f"submitted {job}: a window of {total} rank(s) on {len(cluster.workers)} host(s)")
    logs = Path(tempfile.mkdtemp(prefix=f"muster-up-{job}-"))
    sessions = []
    try:
        for worker in cluster.workers:
            session = start_session(
                worker,
                job,
                (
                    url.scheme,
                    url.hostname or "127.0.0.1",
                    url.port or (443 if url.scheme == "https" else 80),
                ),
                join,
                logs / f"{worker.host}.log",
                gpu_ram_share=cluster.gpu_ram_share_of(worker),
            )
            sessions.append(session)
            err.print(f"[{worker.host}] joining through ssh (log: {session.log})", markup=False)
        watch(sessions, sys.stderr, on_end=lambda s: _host_left(api, job, s))
        state = follow_logs(api, job)
    except BaseException:  # a worker ssh could not reach, or Ctrl-C: the job goes too
        if api.job(job)["state"] not in ("succeeded", "failed", "cancelled"):
            api.cancel(job)
        raise
    finally:
        stop_sessions(sessions)
    err.print(f"{job} {state}; the workers' sessions are in {logs}", markup=False)
    raise typer.Exit(0 if state == "succeeded" else 1)
