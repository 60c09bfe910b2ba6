"""``muster stacks JOB [--rank N] [--native]``: where every rank is, folded.

Ranks whose stacks are the same (process ids and thread ids aside) are printed once, as one
block headed by their ranks; the blocks of the fewest ranks come first, so a rank that is not
where the others are (the one that never reached the collective) is at the top.
"""

from __future__ import annotations

from pathlib import Path

import typer

from muster.cli.common import ControllerOpt, TokenFileOpt, client
from muster.cli.main import app, err, out, reports_errors
from muster.plan.stacks import folded, ranks_label


@app.command()
@reports_errors
def stacks(
    job_id: str = typer.Argument(...),
    rank: int = typer.Option(None, help="only this global rank"),
    native: bool = typer.Option(False, help="with native (C/C++) frames, as py-spy --native"),
    controller: str = ControllerOpt,
    token_file: Path | None = TokenFileOpt,
) -> None:
    """The Python stack of every running rank (py-spy on each agent), folded: ranks that
    are in the same place print once, the odd ones first. The job goes on."""
    answer = client(controller, token_file).stacks(job_id, rank=rank, native=native)
    groups = folded(answer["stacks"])
    majority = len(groups[-1][0]) if groups else 0
    for ranks, text in groups:
        odd = len(groups) > 1 and len(ranks) < majority
        head = f"[{ranks_label(ranks)}]" + (" differs from the others" if odd else "")
        out.print(head, style="bold yellow" if odd else "bold", markup=False)
        out.print("\n".join(f"  {line}" for line in text.splitlines()), markup=False)
    for problem in answer["errors"]:
        err.print(f"node{problem['node']}: {problem['error']}", markup=False)
    if answer["missing"]:
        nodes = ", ".join(f"node{n}" for n in answer["missing"])
        err.print(f"no answer in time from {nodes}", markup=False)
    if not groups:
        if not answer["errors"] and not answer["missing"]:
            err.print("no rank sent a stack (its ranks may have just ended)", markup=False)
        raise typer.Exit(1)
