"""``muster artifacts JOB [--download DIR]``."""

from __future__ import annotations

import hashlib
from pathlib import Path

import typer
from rich.table import Table

from muster.cli.common import ControllerOpt, TokenFileOpt, client
from muster.cli.main import app, out, reports_errors
from muster.errors import InfrastructureError


@app.command()
@reports_errors
def artifacts(
    job_id: str = typer.Argument(...),
    download: Path = typer.Option(None, help="copy every artifact under this directory"),
    controller: str = ControllerOpt,
    token_file: Path | None = TokenFileOpt,
) -> None:
    """List a job's outputs (node<r>/<path>), or download them all, checksums verified."""
    api = client(controller, token_file)
    items = api.artifacts(job_id)
    table = Table(box=None, header_style="bold", pad_edge=False)
    for col in ("PATH", "SIZE", "SHA256"):
        table.add_column(col)
    for item in items:
        table.add_row(item["path"], f"{item['size']:,}", item["sha256"][:16])
        if download is not None:
            dest = download / item["path"]
            api.download_artifact(job_id, item["path"], dest)
            if hashlib.sha256(dest.read_bytes()).hexdigest() != item["sha256"]:
                raise InfrastructureError(f"{item['path']}: checksum mismatch after download")
    out.print(table)
    if download is not None:
        out.print(f"{len(items)} file(s) downloaded to {download}", markup=False)
