"""``muster server``: the controller on one port."""

from __future__ import annotations

import logging
from pathlib import Path

import typer
import uvicorn

from muster.cli.main import app, err, reports_errors
from muster.controller.app import ControllerConfig, create_app, is_loopback
from muster.errors import UserError
from muster.store import data_dir, open_store


@app.command()
@reports_errors
def server(
    host: str = typer.Option("127.0.0.1", help="address to bind; off loopback needs the token"),
    port: int = typer.Option(7070, help="the one port: API, agents' links, /metrics"),
    db: str = typer.Option(None, "--db", help="SQLite path or postgresql://... [data dir]"),
    artifacts: Path = typer.Option(None, help="where bundles and outputs go [data dir]"),
    heartbeat_timeout: float = typer.Option(15.0, help="seconds of agent silence = lost"),
    heartbeat_interval: float = typer.Option(3.0, help="seconds between agent heartbeats"),
) -> None:
    """Run the controller: HTTP API, agents' control links and /metrics on one port."""
    if heartbeat_timeout <= heartbeat_interval:
        raise UserError("--heartbeat-timeout must exceed --heartbeat-interval")
    store = open_store(db)
    config = ControllerConfig(
        store=store,
        artifacts=artifacts or data_dir() / "artifacts",
        host=host,
        heartbeat_interval=heartbeat_interval,
        heartbeat_timeout=heartbeat_timeout,
    )
    application = create_app(config)
    where = store.db.engine.url.render_as_string(hide_password=True)
    err.print(f"muster controller on http://{host}:{port} (database {where})", markup=False)
    if not is_loopback(host):
        err.print("off loopback: every API call and agent needs the token (`muster token`)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    uvicorn.run(application, host=host, port=port, log_level="warning", ws_max_size=64 << 20)
