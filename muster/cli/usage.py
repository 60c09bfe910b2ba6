"""``muster usage JOB``: what a relayed job's members sent through the relays."""

from __future__ import annotations

from pathlib import Path

import typer

from muster.cli.common import ControllerOpt, TokenFileOpt, client
from muster.cli.main import app, out, reports_errors


@app.command()
@reports_errors
def usage(
    job_id: str = typer.Argument(...),
    controller: str = ControllerOpt,
    token_file: Path | None = TokenFileOpt,
) -> None:
    """What each member of a relayed job sent through the relays (GiB, as the relays
    metered it; read every 5 s while the job runs)."""
    answer = client(controller, token_file).usage(job_id)
    out.print(
        f"job {answer['job']} ({answer.get('path_class') or 'not placed'}): "
        f"{answer['relayed_bytes'] / 2**30:.3f} GiB relayed",
        markup=False,
    )
    for member in answer["members"]:
        out.print(
            f"  node{member['node']} ({member.get('worker') or '-'}): "
            f"{member['relayed_bytes'] / 2**30:.3f} GiB",
            markup=False,
        )
