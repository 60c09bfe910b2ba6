"""``muster verify-fabric``: did NCCL attach to the cluster fabric or fall back to TCP?"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from muster.cli.common import ControllerOpt, TokenFileOpt, client
from muster.cli.main import app, out, reports_errors
from muster.client import Client
from muster.errors import FieldError, SpecError, UserError
from muster.k8s.fabric import BANNER
from muster.k8s.verify import analyse

COLOURS = {"attached": "green", "fallback": "red", "inconclusive": "yellow", "other fabric": "red"}


@app.command("verify-fabric")
@reports_errors
def verify_fabric(
    source: str | None = typer.Argument(None, help="a file of NCCL output, or - for stdin"),
    k8s: str | None = typer.Option(None, "--k8s", help="read a TrainJob's node pods"),
    job: str | None = typer.Option(None, "--job", help="read a muster job's stored logs"),
    fabric: str | None = typer.Option(None, "--fabric", help="expected: tcpxo, efa or ib"),
    namespace: str = typer.Option("default", "--namespace", "-n", help="with --k8s"),
    context: str | None = typer.Option(None, "--context", help="with --k8s: kubeconfig context"),
    replicated_job: str = typer.Option(
        "node", "--replicated-job", help="with --k8s: node, or launcher under an MPI runtime"
    ),
    controller: str | None = ControllerOpt,
    token_file: Path | None = TokenFileOpt,
) -> None:
    """Read NCCL's 'Using network' banner per rank. Exit 0 attached, 1 fallback, 3 unknown,
    5 attached to another fabric than --fabric."""
    given = [s for s in (source, k8s, job) if s]
    if len(given) != 1:
        raise UserError("give exactly one of FILE (or - for stdin), --k8s TRAINJOB, --job JOB")
    if fabric is not None and fabric not in BANNER:
        raise SpecError([FieldError("--fabric", f"{fabric!r}: choose tcpxo, efa or ib")])
    if source == "-":
        lines = sys.stdin.read().splitlines()
    elif source:
        path = Path(source)
        if not path.is_file():
            raise UserError(f"{source}: no such file")
        lines = path.read_text(errors="replace").splitlines()
    elif k8s:
        from muster.k8s.cluster import Cluster

        lines = Cluster.connect(namespace, context).logs(k8s, replicated_job)
    else:
        lines = _stored(client(controller, token_file), str(job))
    report = analyse(lines, fabric)
    colour = COLOURS[report.verdict]
    out.print(f"[{colour}]{report.verdict}[/]: ", end="", markup=True)
    out.print(report.summary, markup=False)
    for rank in report.ranks:
        out.print(f"  {rank.name}: {rank.network or 'no banner'}", markup=False)
    if report.cause:
        out.print(f"likely cause: {report.cause}", markup=False)
    raise typer.Exit(report.exit_code)


def _stored(api: Client, job: str) -> list[str]:
    """A muster job's stored lines, page by page, tagged as `muster logs` prints them."""
    lines: list[str] = []
    cursor = ""
    while True:
        page = api.logs(job, after=cursor, limit=50_000)
        for line in page["lines"]:
            tag = f"rank{line['rank']}" if line["origin"] == "rank" else f"node{line['rank']}"
            lines.append(f"[{tag}] {line['text']}")
        if not page["lines"] or page["next"] == cursor:
            return lines
        cursor = page["next"]
