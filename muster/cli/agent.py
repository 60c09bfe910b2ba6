"""``muster agent``: offer this machine to a controller."""

from __future__ import annotations

import asyncio
import fcntl
import ipaddress
import logging
import os
import re
import socket
import sys
from pathlib import Path
from typing import IO
from urllib.parse import urlparse

import typer

from muster.agent.agent import Agent, AgentConfig
from muster.agent.datasource import SshfsSource
from muster.agent.inventory import (
    advertise_address_for,
    check_interface,
    collect,
    interface_of,
)
from muster.agent.prepare import NotReady, Preparation
from muster.agent.retention import remove_stale_job_dirs
from muster.agent.tunnel import SshTunnel
from muster.cli.common import read_secret
from muster.cli.gc import parse_retention
from muster.cli.main import app, reports_errors
from muster.client import controller_url, split_token
from muster.errors import UserError
from muster.net.wireguard import claim_device, device_unavailable
from muster.spec import MESH_INTERFACE, WorkerInventory
from muster.spec.cluster import ssh_option_problem
from muster.spec.worker import LOCATION, UNDECLARED, WalkIn
from muster.store import ensure_data_dir
from muster.store.engine import make_private_dir
from muster.wire import open_worker_id

# Where a host is: the same options on `muster agent` and `muster join`.
PROVIDER = typer.Option(
    "local",
    envvar="MUSTER_PROVIDER",
    help="the provider this host is in (aws, gcp, onprem); with --region, it places "
    "`network: colocated` jobs and sizes the direct path's packets [local: undeclared]",
)
REGION = typer.Option(
    "local", envvar="MUSTER_REGION", help="the provider's region (us-east-1) [local]"
)
REGION_CLASS = typer.Option(
    "local",
    envvar="MUSTER_REGION_CLASS",
    help="regions close enough for `network: regional` jobs (us, eu) [local]",
)


@app.command()
@reports_errors
def agent(
    controller: str = typer.Option(
        None,
        "--controller",
        "-c",
        envvar="MUSTER_CONTROLLER",
        help="controller URL [default: http://127.0.0.1:7070]",
    ),
    token_file: Path = typer.Option(
        None,
        "--token-file",
        help="file (mode 0600) holding the join string `muster token` prints [or set MUSTER_TOKEN]",
    ),
    name: str = typer.Option(None, help="worker id [default: hostname]"),
    python: str = typer.Option(sys.executable, help="the Python the jobs run with"),
    work_dir: Path = typer.Option(None, help="where jobs unpack and run [data dir]"),
    advertise_address: str = typer.Option(None, help="address other nodes reach this one at"),
    private_network: str = typer.Option(
        None,
        help="id of the private network this host shares with others (one VPC, one rack "
        "LAN); agents with the same id and region may take the private path [none]",
    ),
    interface: str = typer.Option(
        None,
        help="network interface the ranks bind (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME) "
        "[the one holding the advertise address]",
    ),
    provider: str = PROVIDER,
    region: str = REGION,
    region_class: str = REGION_CLASS,
    device: str = typer.Option(
        None,
        help="name of this agent's WireGuard device on the direct path; two agents on one "
        "host need two names [the first free of muster0, muster1, ...]",
    ),
    persist: bool = typer.Option(False, help="dial again forever when the link is lost"),
    path_timeout: float = typer.Option(
        60.0,
        min=5.0,
        help="seconds without a packet from a direct-path peer before the job's "
        "NetworkDegraded condition says the pair lost its path (idle tunnels send a "
        "keepalive every 25 s)",
    ),
    handshake_timeout: float = typer.Option(
        30.0,
        min=5.0,
        max=90.0,
        help="seconds a new direct-path device waits for a WireGuard handshake with every "
        "peer before the epoch is fenced, naming the silent ones (wireguard-go retries a "
        "handshake every 5 s; the controller's bound on the whole set-up is 120 s)",
    ),
    direct_mtu: int = typer.Option(
        None,
        min=1280,
        max=1420,
        help="the most this host's direct-path device takes: for a path that carries less "
        "than its link says (PPPoE, a VPN underneath) [the gang's 1280, or 1420 in one "
        "declared region, less what the uplink lacks]",
    ),
    grace: float = typer.Option(10.0, help="seconds between SIGTERM and SIGKILL on stop"),
    retention: str = typer.Option(
        "0",
        help="delete work-dir job directories untouched for this long (7d, 36h) and not "
        "running here; 0 keeps them forever",
    ),
) -> None:
    """Dial the controller and run the gang members it assigns here."""
    serve(
        controller,
        token_file,
        name or socket.gethostname(),
        python=python,
        work_dir=work_dir,
        advertise_address=advertise_address,
        private_network=private_network,
        location=(provider, region, region_class),
        interface=interface,
        device=device,
        persist=persist,
        path_timeout=path_timeout,
        grace=grace,
        retention=retention,
        handshake_timeout=handshake_timeout,
        direct_mtu=direct_mtu,
    )


@app.command()
@reports_errors
def join(
    controller: str = typer.Argument(
        None, envvar="MUSTER_CONTROLLER", help="controller URL [default: http://127.0.0.1:7070]"
    ),
    job: str = typer.Option(
        None,
        "--job",
        "-j",
        help="the membership: window job to walk in to [the oldest open window; with "
        "--persist, each next run]",
    ),
    token_file: Path = typer.Option(
        None,
        "--token-file",
        help="file (mode 0600) holding the join string `muster token` prints [or set MUSTER_TOKEN]",
    ),
    devices: str = typer.Option(
        None, help="GPUs to offer, e.g. 0,1: one rank each, and the ranks see only these [all]"
    ),
    procs: int = typer.Option(
        None, min=1, max=1024, help="ranks this box offers without GPUs [one per GPU, or 1]"
    ),
    host: str = typer.Option(None, help="this box's name on the roster [hostname]"),
    name: str = typer.Option(None, help="worker id [walkin-HOST]"),
    python: str = typer.Option(sys.executable, help="the Python the ranks run with"),
    work_dir: Path = typer.Option(None, help="where the job unpacks and runs [data dir]"),
    advertise_address: str = typer.Option(None, help="address other nodes reach this one at"),
    private_network: str = typer.Option(
        None, help="id of the private network this box shares with the others [none]"
    ),
    interface: str = typer.Option(None, help="network interface the ranks bind"),
    provider: str = PROVIDER,
    region: str = REGION,
    region_class: str = REGION_CLASS,
    persist: bool = typer.Option(
        False, help="when refused, or the link is lost, dial again (5 s doubling to 60 s)"
    ),
    direct_mtu: int = typer.Option(
        None,
        min=1280,
        max=1420,
        help="the most this box's direct-path device takes (see muster agent --direct-mtu)",
    ),
    grace: float = typer.Option(10.0, help="seconds between SIGTERM and SIGKILL on stop"),
    data_path: Path = typer.Option(
        None,
        help="the data root this box's ranks read (MUSTER_DATA_PATH); its files' signature "
        "must match the other boxes'",
    ),
    gpu_ram_share: float = typer.Option(
        None, min=0.01, max=4.0, help="APU boxes: the share of RAM its GPU claims (to ranks)"
    ),
    data_source: str = typer.Option(
        None,
        help="sshfs://[user@]host[:port]:/dir: mount it read-only on --data-path when it is "
        "not there (before each dial), with the --ssh-identity key and --ssh-option options",
    ),
    ssh: str = typer.Option(
        None,
        help="[user@]host[:port]: dial through an ssh -L forward to this host (fresh each "
        "dial, never a password prompt); CONTROLLER is then the controller as that host sees "
        "it [http://127.0.0.1:7070]",
    ),
    ssh_identity: Path = typer.Option(None, help="the key ssh uses (-i)"),
    ssh_option: list[str] = typer.Option(
        [], "--ssh-option", help="an ssh -o option, Key=Value (repeatable)"
    ),
    open_admission: bool = typer.Option(
        False,
        "--open-admission",
        help="walk in without the join string: only to a --job whose window has "
        "open_admission: true (a network you trust entirely)",
    ),
    tls_fingerprint: str = typer.Option(
        None,
        help="with --open-admission over https: the controller certificate's sha256 (the "
        "part of `muster token` after the dot) [the system's CAs]",
    ),
) -> None:
    """Walk in to a job's join window: offer this box's ranks, run its part once the world
    forms, and leave when the job ends."""
    roster_name = host or socket.gethostname()
    if open_admission and job is None:
        raise UserError("--open-admission needs --job: the job whose window is open to all")
    if tls_fingerprint is not None and not open_admission:
        raise UserError("--tls-fingerprint is for --open-admission (the join string has it)")
    if open_admission and not controller_url(controller).startswith("https://"):
        logging.getLogger("muster.agent").warning(
            "--open-admission over http: nothing proves the controller is the one you meant, "
            "and anyone on the path can take this box's session (and run code on it); use "
            "https with --tls-fingerprint where the network is not entirely yours"
        )
    for option in ssh_option:  # for --ssh and --data-source alike
        problem = ssh_option_problem(option)
        if problem:
            raise UserError(f"--ssh-option: {problem}")
    if devices is not None and procs is not None:
        raise UserError("--devices and --procs: give one (GPU ranks, or CPU ranks)")
    offered = parse_devices(devices) if devices is not None else None
    worker_id = name or f"walkin-{roster_name}"
    if open_admission:  # the only names such a link may have
        worker_id = open_worker_id(job, name or roster_name)
    work_dir = work_dir or ensure_data_dir() / "agents" / worker_id
    host_env: dict[str, str] = {}
    source = None
    if data_source is not None:
        if data_path is None:
            raise UserError("--data-source needs --data-path: the directory to mount it on")
        source = SshfsSource(
            data_source,
            data_path.resolve(),
            identity_file=str(ssh_identity) if ssh_identity else None,
            options=list(ssh_option),
        )
        source.ensure()  # before the signature: it is of the mounted files
    if data_path is not None:
        data_path = data_path.resolve()
        host_env["MUSTER_DATA_PATH"] = str(data_path)
    # The GPU gate, the stage directory and the data's signature: now (a clear error), then
    # again before every dial.
    prepare = Preparation(work_dir, offered, data_path)
    try:
        prepare.check()
    except NotReady as exc:
        raise UserError(str(exc)) from exc
    if gpu_ram_share is not None:
        host_env["MUSTER_GPU_RAM_SHARE"] = f"{gpu_ram_share:g}"
    if offered is not None:
        # Every rank of this box sees exactly these GPUs (LOCAL_RANK indexes into them), and
        # so does the inventory probe that counts them.
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, offered))
    tunnel = None
    if ssh is not None:
        seen = urlparse(controller_url(controller))
        tunnel = SshTunnel(
            ssh,
            seen.hostname or "127.0.0.1",
            seen.port or (443 if seen.scheme == "https" else 80),
            identity_file=str(ssh_identity) if ssh_identity else None,
            options=list(ssh_option),
        )
        controller = tunnel.url(seen.scheme or "http")
    serve(
        controller,
        token_file,
        worker_id,
        python=python,
        work_dir=work_dir,
        advertise_address=advertise_address,
        private_network=private_network,
        location=(provider, region, region_class),
        interface=interface,
        device=None,
        persist=persist,
        path_timeout=60.0,
        grace=grace,
        retention="0",
        direct_mtu=direct_mtu,
        walk_in=(
            job,
            roster_name,
            len(offered) if offered is not None else procs,
            prepare.data_sig,
        ),
        backoff=(5.0, 60.0),
        tunnel=tunnel,
        host_env=host_env,
        data_source=source,
        prepare=prepare,
        open_to=(job, tls_fingerprint) if open_admission else None,
    )


def serve(
    controller: str | None,
    token_file: Path | None,
    worker_id: str,
    *,
    python: str,
    work_dir: Path | None,
    advertise_address: str | None,
    private_network: str | None,
    interface: str | None,
    device: str | None,
    location: tuple[str, str, str] = (UNDECLARED, UNDECLARED, UNDECLARED),
    persist: bool,
    path_timeout: float,
    grace: float,
    retention: str,
    handshake_timeout: float = 30.0,
    direct_mtu: int | None = None,
    walk_in: tuple[str | None, str, int | None, str | None] | None = None,
    backoff: tuple[float, float] | None = None,
    tunnel: SshTunnel | None = None,
    host_env: dict[str, str] | None = None,
    data_source: SshfsSource | None = None,
    prepare: Preparation | None = None,
    open_to: tuple[str, str | None] | None = None,
) -> None:
    """Run an agent until its link ends (or for ever with ``persist``); exits with its code.
    ``open_to`` (job, certificate fingerprint): walk in to that job without the join string."""
    keep_for = parse_retention(retention, "--retention")
    for flag, value in zip(("--provider", "--region", "--region-class"), location, strict=True):
        if not re.fullmatch(LOCATION, value):
            raise UserError(
                f"{flag} {value!r}: a name is 1-63 letters, digits and '_.:-', starting with "
                "a letter or digit (aws, us-east-1)"
            )
    url = controller_url(controller)
    token = read_secret(token_file, "MUSTER_TOKEN", "the join string")
    if open_to is not None:
        if token is not None:
            raise UserError(
                "--open-admission walks in without the join string: drop --token-file "
                "(or unset MUSTER_TOKEN)"
            )
        token = "" if open_to[1] is None else f".sha256:{open_to[1].removeprefix('sha256:')}"
    if token is None:
        also = " (or --open-admission, to a window open to all)" if walk_in else ""
        raise UserError(
            "no join string: put what `muster token` prints on the controller in a file "
            f"(chmod 600) and pass --token-file, or set MUSTER_TOKEN{also}"
        )
    # The ranks this agent starts never see it (muster.plan.env scrubs it too).
    os.environ.pop("MUSTER_TOKEN", None)
    secret, pin = split_token(token)
    # Through a tunnel the controller is local: the ranks' address is the one that routes to
    # the ssh host.
    toward = f"ssh://{_bracketed(tunnel.host)}" if tunnel is not None else url
    try:
        address = advertise_address or advertise_address_for(toward)
    except OSError as exc:
        raise UserError(
            f"cannot tell which of this box's addresses reaches {toward} ({exc}); "
            "pass --advertise-address"
        ) from exc
    bound_interface = check_interface(interface) if interface else None
    held_by = interface_of(address) if not _is_loopback(address) else None
    device_name, claim = MESH_INTERFACE, None
    if device_unavailable() is None:  # it can make devices: claim a name no other agent has
        device_name, claim = claim_device(device)
    config = AgentConfig(
        controller=url,
        token=secret,
        fingerprint=pin,
        worker_id=worker_id,
        work_dir=work_dir or ensure_data_dir() / "agents" / worker_id,
        python=python,
        inventory=lambda: offer(
            collect(
                worker_id,
                python,
                address,
                private_network,
                interface=bound_interface,
                device=device_name,
                location=location,
            ),
            walk_in,
        ),
        persist=persist,
        grace=grace,
        retention=keep_for,
        path_timeout=path_timeout,
        handshake_timeout=handshake_timeout,
        direct_mtu=direct_mtu,
        uplink=held_by,
        device=device_name,
    )
    if backoff is not None:
        config.backoff = backoff
    config.tunnel = tunnel
    config.host_env = dict(host_env or {})
    config.data_source = data_source
    config.prepare = prepare
    config.open_job = open_to[0] if open_to is not None else None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if path_timeout < 30:
        logging.getLogger("muster.agent").warning(
            "--path-timeout %.0f is under two keepalives (25 s each): an idle direct tunnel "
            "will read as a lost path",
            path_timeout,
        )
    held = claim_work_dir(config.work_dir)  # before anything in it is swept
    remove_stale_job_dirs(config.work_dir, keep_for)  # nothing runs here yet
    try:
        code = asyncio.run(Agent(config).run())
    finally:
        if claim is not None:
            claim.close()  # (the name is this agent's until here)
        held.close()
    raise typer.Exit(code)


def claim_work_dir(work_dir: Path) -> IO[str]:
    """One agent per work dir. An agent sweeps what a crashed run of it left (its job dirs,
    its nftables table, its ranks' cgroups, all named after its worker id and work dir), so a
    second live agent there, of this cluster or another (both default to the host's name),
    would stop the first one's ranks. The claim is a lock on ``.agent.lock`` in the dir, held
    until this process ends (even killed); raises UserError naming the holder."""
    try:
        make_private_dir(work_dir)
        lock = open(work_dir / ".agent.lock", "a+")  # noqa: SIM115 (held for the agent's life)
    except OSError as exc:
        raise UserError(
            f"the work dir {work_dir} takes no writes ({exc.strerror or exc}); "
            "free it, fix its permissions or pass --work-dir"
        ) from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        raise UserError(
            f"another muster agent ({holder}) runs in {work_dir}: give this one its own "
            "--work-dir (or another --name, whose default work dir is its own)"
        ) from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"pid {os.getpid()}\n")
    lock.flush()
    return lock


def parse_devices(text: str) -> list[int]:
    try:
        found = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        found = []
    if not found or any(d < 0 for d in found) or len(set(found)) != len(found):
        raise UserError(f"--devices {text!r}: list distinct GPU indices, e.g. --devices 0,1")
    return found


def offer(
    inventory: WorkerInventory, walk_in: tuple[str | None, str, int | None, str | None] | None
) -> WorkerInventory:
    """A walk-in's inventory names its job, its roster name and its ranks: as asked, else one
    per GPU it sees, else one."""
    if walk_in is None:
        return inventory
    job, host, ranks, data_sig = walk_in
    ranks = ranks or inventory.gpus.count or 1
    join = WalkIn(job=job, host=host, ranks=ranks, data_sig=data_sig)
    return inventory.model_copy(update={"join": join})


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False  # a name: the peers resolve it
