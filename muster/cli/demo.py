"""``muster demo``: a controller, two agents and the DDP example, all on this machine."""

from __future__ import annotations

import re
from pathlib import Path

import typer
from rich.table import Table

from muster.cli.follow import follow_logs
from muster.cli.local import LocalCluster
from muster.cli.main import app, err, out, reports_errors
from muster.errors import UserError
from muster.spec import load_job_file


@app.command()
@reports_errors
def demo(
    job: Path | None = typer.Argument(
        None, help="the job to run, as --job [examples/ddp/job.yaml]", show_default=False
    ),
    job_option: Path | None = typer.Option(
        None, "--job", help="the job to run [examples/ddp/job.yaml]", show_default=False
    ),
    agents: int = typer.Option(2, help="local agents to start"),
) -> None:
    """Run a job on a throwaway local cluster: controller (SQLite), agents, logs, summary."""
    if job is not None and job_option is not None and job != job_option:
        raise UserError(f"two jobs given ({job} and --job {job_option}): give one")
    job_file = job or job_option or default_job()
    if not job_file.is_file():
        if job is None and job_option is None:
            raise UserError(f"{job_file} not found; run from the muster checkout or name a job")
        what = "is a directory, not a job file" if job_file.is_dir() else "not found"
        raise UserError(f"{job_file} {what} (the job file to run)")
    spec = load_job_file(job_file)
    cluster = LocalCluster(agents=agents)
    with err.status("starting a controller and agents on loopback"):
        cluster.__enter__()
    try:
        err.print(
            f"controller {cluster.url}, {agents} agents, data in {cluster.data_dir}; "
            f"dashboard {cluster.url}/ while it runs",
            markup=False,
        )
        api = cluster.client()
        job_id = api.submit_with_bundle(spec, (job_file.parent / spec.workdir).resolve())["id"]
        err.print(f"submitted {job_id}", markup=False)
        state = follow_logs(api, job_id)
        summary(api.job(job_id), api.logs(job_id, limit=50_000)["lines"], api.artifacts(job_id))
    finally:
        with err.status("stopping the agents and the controller"):
            cluster.__exit__(None, None, None)
    raise typer.Exit(0 if state == "succeeded" else 1)


def default_job() -> Path:
    """The DDP example: the current directory's (a checkout), else the one beside the
    installed package (an editable install from any directory); a wheel ships none."""
    here = Path("examples/ddp/job.yaml")
    beside = Path(__file__).resolve().parents[2] / here
    return beside if not here.is_file() and beside.is_file() else here


def summary(
    job: dict[str, object], lines: list[dict[str, object]], artifacts: list[dict[str, object]]
) -> None:
    last: dict[int, str] = {}  # each rank's last line about the loss, else its last line
    reduce: dict[int, str] = {}
    for line in lines:
        if line["origin"] != "rank":
            continue
        rank, text = int(str(line["rank"])), str(line["text"])
        if "all_reduce" in text:
            reduce[rank] = text
        if re.search(r"loss", text) or not re.search(r"loss", last.get(rank, "")):
            last[rank] = text
    table = Table(title=f"{job['id']}: {job['state']}", box=None, header_style="bold")
    columns = ("RANK", "ALL_REDUCE", "LAST") if reduce else ("RANK", "LAST")
    for col in columns:
        table.add_column(col)
    for rank in sorted(set(reduce) | set(last)):
        cells = [str(rank), reduce.get(rank, "-"), last.get(rank, "-")]
        table.add_row(*(cells if reduce else [cells[0], cells[2]]))
    out.print(table)
    if job.get("root_cause"):
        out.print(f"root cause: {job['root_cause']}", markup=False)
    for item in artifacts:
        out.print(
            f"artifact {item['path']}  {item['size']:,} bytes  sha256 {str(item['sha256'])[:16]}",
            markup=False,
        )
