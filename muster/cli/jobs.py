"""``muster submit``, ``get``, ``describe``, ``cancel``."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from muster.cli.common import ControllerOpt, TokenFileOpt, client
from muster.cli.follow import follow_logs
from muster.cli.main import app, err, out, reports_errors
from muster.errors import UserError
from muster.spec import load_job_file

TERMINAL = {"succeeded", "failed", "cancelled"}


@app.command()
@reports_errors
def submit(
    job_file: Path = typer.Argument(..., help="the job's YAML file"),
    follow: bool = typer.Option(False, "--follow", "-f", help="stream logs until it ends"),
    controller: str = ControllerOpt,
    token_file: Path | None = TokenFileOpt,
) -> None:
    """Validate a job, upload its workdir as the source bundle, and queue it."""
    spec = load_job_file(job_file)
    api = client(controller, token_file)
    job = api.submit_with_bundle(spec, (job_file.parent / spec.workdir).resolve())
    err.print(f"submitted {job['id']}", markup=False)
    window = spec.gang.window
    if spec.gang.membership == "window" and window is not None and window.open_admission:
        err.print(
            f"[yellow]warning:[/] job {job['id']} has open_admission: any box that reaches "
            "the controller walks in without the join string (muster join --open-admission), "
            "runs this job's code and joins its world; use it only on a network you trust "
            "entirely"
        )
    out.print(job["id"], markup=False)
    if follow:
        state = follow_logs(api, job["id"])
        raise typer.Exit(0 if state == "succeeded" else 1)


@app.command("get")
@reports_errors
def get(
    what: str = typer.Argument(..., help="jobs or workers"),
    controller: str = ControllerOpt,
    token_file: Path | None = TokenFileOpt,
) -> None:
    """List jobs or workers."""
    api = client(controller, token_file)
    table = Table(box=None, header_style="bold", pad_edge=False)
    if what in ("jobs", "job"):
        for col in ("JOB", "STATE", "PATH", "SUBMITTED", "WHY PENDING / ROOT CAUSE"):
            table.add_column(col)
        for j in api.jobs():
            note = j["why_pending"] if j["state"] == "queued" else (j["root_cause"] or "")
            table.add_row(
                j["id"],
                j["state"],
                j["path_class"] or "",
                j["submitted_at"][:19],
                (note or "").split("\n")[0],
            )
    elif what in ("workers", "worker"):
        columns = ("WORKER", "STATE", "JOB", "ADDRESS", "REGION", "TORCH", "GPUS", "DIRECT")
        for col in (*columns, "CONNECTED"):
            table.add_column(col)
        for w in api.workers():
            table.add_row(
                w["id"],
                w["state"],
                w["job"] or "",
                w["advertise_address"] or "",
                # provider/region as its agent declared them; "-" when it declared none.
                "-" if w.get("region", "local") == "local" else f"{w['provider']}/{w['region']}",
                w["torch"] or "-",
                str(w["gpus"]),
                # It can make the direct path's WireGuard device (see README: networks).
                "yes" if (w.get("network") or {}).get("can_create_device") else "no",
                "yes" if w["connected"] else "no",
            )
    else:
        raise UserError(f"muster get {what!r}: use `muster get jobs` or `muster get workers`")
    out.print(table)


@app.command()
@reports_errors
def describe(
    job_id: str = typer.Argument(...),
    controller: str = ControllerOpt,
    token_file: Path | None = TokenFileOpt,
) -> None:
    """A job's state, members, addresses, rank ranges, events and root cause."""
    job = client(controller, token_file).job(job_id)
    out.print(
        f"[bold]{job['id']}[/]  {job['state']}  world size {job['world_size'] or '?'}"
        f"  path {job['path_class'] or '-'}"
    )
    if job.get("spec_error"):
        out.print(job["spec_error"], style="yellow", markup=False)
    if job["why_pending"] and job["state"] == "queued":
        out.print(f"why pending: {job['why_pending']}", markup=False)
    if job["root_cause"]:
        out.print("root cause:", style="red")
        out.print(job["root_cause"], markup=False)
    if job["members"]:
        table = Table(title="members", box=None, header_style="bold", pad_edge=False)
        for col in ("NODE", "WORKER", "RANKS", "STATE", "EXIT", "ADDRESS"):
            table.add_column(col)
        for m in job["members"]:
            exit_text = m["signal"] or ("" if m["exit_code"] is None else str(m["exit_code"]))
            table.add_row(
                f"node{m['node_rank']}",
                m["worker"],
                f"{m['ranks'][0]}-{m['ranks'][1]}" if m["ranks"] else "?",
                m["state"],
                exit_text,
                m["path_address"] or m["advertise_address"] or "",
            )
        out.print(table)
    for c in job.get("conditions") or []:
        line = f"condition {c['type']}={c['status']} ({c['reason']}): {c['message']}"
        out.print(line, markup=False)
    for probe in (e for e in job["events"] if e["kind"] == "Probe"):  # every epoch's
        data = probe["data"]
        epoch = data.get("epoch")
        title = f"probe, epoch {epoch}" if epoch is not None else "probe"
        table = Table(title=title, box=None, header_style="bold", pad_edge=False)
        for col in ("PAIR", "GBIT/S", "RTT MS", "PATH TAKEN"):
            table.add_column(col)
        for pair in data.get("pairs", []):
            gbps = pair.get("tcpGbps")
            taken = pair.get("via") or "-"
            if pair.get("endpoint"):
                taken += f" to {pair['endpoint']}"
            table.add_row(
                f"node{pair['a']}-node{pair['b']}",
                "-" if gbps is None else f"{gbps:.2f}",
                str(pair.get("rttMs")),
                taken,
            )
        out.print(table)
    events = Table(title="events", box=None, header_style="bold", pad_edge=False)
    for col in ("TIME", "EVENT", "MESSAGE"):
        events.add_column(col)
    for e in job["events"]:
        events.add_row(e["time"][11:23], e["kind"], e["message"].split("\n")[0])  # UTC, ms
    out.print(events)


@app.command()
@reports_errors
def cancel(
    job_id: str = typer.Argument(...),
    controller: str = ControllerOpt,
    token_file: Path | None = TokenFileOpt,
) -> None:
    """Cancel a job: stop its running members, cancel the rest."""
    job = client(controller, token_file).cancel(job_id)
    out.print(f"{job['id']} {job['state']}", markup=False)
