"""Printing a job's logs as ``[rank3] text``, once or following."""

from __future__ import annotations

import time

from muster.cli.main import err, out
from muster.client import Client

TERMINAL = {"succeeded", "failed", "cancelled"}


def print_lines(lines: list[dict[str, object]]) -> None:
    for line in lines:
        label = f"rank{line['rank']}" if line["origin"] == "rank" else f"node{line['rank']}"
        out.print(f"[{label}] {line['text']}", markup=False, highlight=False)


def follow_logs(
    api: Client,
    job_id: str,
    *,
    rank: int | None = None,
    node: int | None = None,
    follow: bool = True,
    poll: float = 0.3,
) -> str:
    """Print lines until the job ends (or once); returns the job's last state."""
    cursor = ""
    state = ""
    shown_state = ""
    with err.status(f"{job_id}: waiting for logs") as status:
        while True:
            page = api.logs(job_id, rank=rank, node=node, after=cursor)
            cursor, state = page["next"], page["state"]
            if page["lines"]:
                status.stop()
                print_lines(page["lines"])
            if len(page["lines"]) >= 10_000:
                continue
            if not follow or state in TERMINAL:
                break
            if state != shown_state:
                status.update(f"{job_id}: {state}")
                shown_state = state
            time.sleep(poll)
    return str(state)
