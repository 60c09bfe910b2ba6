"""``muster server``: the controller on one port."""

from __future__ import annotations

import logging
from pathlib import Path
from types import FrameType

import typer
import uvicorn

from muster.cli.gc import parse_retention
from muster.cli.main import app, err, reports_errors
from muster.cli.relay import host_port, read_secret
from muster.controller.app import ControllerConfig, create_app
from muster.controller.auth import is_loopback
from muster.controller.links import LINK_MAX_BYTES
from muster.controller.retention import start_collecting
from muster.controller.tls import controller_certificate, fingerprint, write_pem_files
from muster.errors import UserError
from muster.store import ensure_data_dir, open_store


@app.command()
@reports_errors
def server(
    host: str = typer.Option("127.0.0.1", help="address to bind; off loopback needs the token"),
    port: int = typer.Option(7070, help="the one port: API, dashboard, agents' links, /metrics"),
    db: str = typer.Option(None, "--db", help="SQLite path or postgresql://... [data dir]"),
    artifacts: Path = typer.Option(None, help="where bundles and outputs go [data dir]"),
    heartbeat_timeout: float = typer.Option(15.0, help="seconds of agent silence = lost"),
    heartbeat_interval: float = typer.Option(3.0, help="seconds between agent heartbeats"),
    tls: bool = typer.Option(
        None, "--tls/--no-tls", help="serve HTTPS/WSS [default: on off loopback]"
    ),
    tls_cert: Path = typer.Option(None, help="PEM certificate [made at first start]"),
    tls_key: Path = typer.Option(None, help="PEM key for --tls-cert"),
    max_bundle_mb: int = typer.Option(512, help="largest source bundle accepted, in MiB"),
    max_artifact_mb: int = typer.Option(8192, help="largest single output file, in MiB"),
    retention: str = typer.Option(
        "0",
        help="hourly, delete outputs and unused bundles of jobs that ended longer ago than "
        "this (7d, 36h); 0 keeps them forever",
    ),
    retention_logs: bool = typer.Option(
        False, "--retention-logs", help="with --retention, delete those jobs' log lines too"
    ),
    relay: list[str] = typer.Option(
        [], "--relay", help="a `muster relay` (HOST:PORT) for the relayed path; repeat for two"
    ),
    relay_secret_file: Path = typer.Option(
        None, help="the secret shared with the relays (the file their --secret-file reads)"
    ),
    relay_max_gbps: float = typer.Option(
        1.0, help="the most one relayed gang sends through the relays (Gbit/s, all members)"
    ),
) -> None:
    """Run the controller: HTTP API, agents' control links and /metrics on one port."""
    if heartbeat_timeout <= heartbeat_interval:
        raise UserError("--heartbeat-timeout must exceed --heartbeat-interval")
    if max_bundle_mb < 1 or max_artifact_mb < 1:
        raise UserError("--max-bundle-mb and --max-artifact-mb must be at least 1")
    keep_for = parse_retention(retention, "--retention")
    relays = tuple(host_port(r, "--relay") for r in relay)
    if not relay_max_gbps > 0:
        raise UserError("--relay-max-gbps must be above 0")
    secret = read_secret(relay_secret_file, "--relay-secret-file") if relays else b""
    store = open_store(db)
    loopback = is_loopback(host)
    if tls is None:
        tls = not loopback
    if not tls and not loopback:
        raise UserError("--no-tls is only allowed on loopback; off loopback muster serves TLS")
    cert_pem, key_pem = controller_certificate(store, tls_cert, tls_key)
    cert_file = key_file = None
    if tls:
        cert_path, key_path = write_pem_files(ensure_data_dir() / "tls", cert_pem, key_pem)
        cert_file, key_file = str(cert_path), str(key_path)
    config = ControllerConfig(
        store=store,
        artifacts=artifacts or ensure_data_dir() / "artifacts",
        host=host,
        heartbeat_interval=heartbeat_interval,
        heartbeat_timeout=heartbeat_timeout,
        tls=tls,
        max_bundle_bytes=max_bundle_mb << 20,
        max_artifact_bytes=max_artifact_mb << 20,
        port=port,
        relays=relays,
        relay_secret=secret,
        relay_max_gbps=relay_max_gbps,
    )
    application = create_app(config)
    if keep_for:
        start_collecting(store, config.artifacts, keep_for, logs=retention_logs)
    where = store.db.engine.url.render_as_string(hide_password=True)
    scheme = "https" if tls else "http"
    err.print(f"muster controller on {scheme}://{host}:{port} (database {where})", markup=False)
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    err.print(f"dashboard: {scheme}://{shown}:{port}/", markup=False)
    if tls:
        err.print(
            f"TLS certificate sha256:{fingerprint(cert_pem)}; agents need the join string "
            "`muster token` prints, API calls the one `muster token --api` prints",
            markup=False,
        )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    server_ = uvicorn.Server(
        uvicorn.Config(
            application,
            host=host,
            port=port,
            log_level="warning",
            ws="websockets-sansio",  # its per-frame size cap keeps handshakes to a few KiB
            ws_max_size=LINK_MAX_BYTES,
            ws_per_message_deflate=False,  # small frames; compressing them costs more CPU
            ssl_certfile=cert_file,
            ssl_keyfile=key_file,
        )
    )
    stop = server_.handle_exit

    def handle_exit(sig: int, frame: FrameType | None) -> None:
        # Before uvicorn closes the agents' links: links that close now lose no host.
        application.state.controller.exiting = True
        stop(sig, frame)

    server_.handle_exit = handle_exit  # type: ignore[method-assign]
    server_.run()
