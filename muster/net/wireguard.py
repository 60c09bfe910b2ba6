"""The direct path's device: one WireGuard interface per member and epoch, next to the job.

The agent makes it, never the job: a fresh X25519 key pair (the private key never leaves this
host and never goes on a command line: ``wg`` reads it on stdin), a device ``muster0`` with the
member's mesh address, the gang's MTU (1280, safe across providers; 1420 in one declared
provider region; never more than the uplink carries: muster.plan.mesh_mtu, device_mtu), and
the gang's peers with a 25 s keepalive. Kernel WireGuard is used where the kernel has it;
otherwise ``wireguard-go`` (user space, run in the foreground as the agent's child, with a
parent-death signal, so it goes when the agent does, even killed). Removing the device ends
wireguard-go.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import psutil
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from muster.errors import InfrastructureError, UserError
from muster.plan import MESH_MTU
from muster.spec.network import MESH_INTERFACE

KEEPALIVE_S = 25
WG_SOCKETS = Path("/run/wireguard")
START_TIMEOUT_S = 10.0
COMMAND_TIMEOUT_S = 15.0
CAP_NET_ADMIN = 12
PR_SET_PDEATHSIG = 1


DEVICE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,15}$")  # what Linux takes as an interface name
DEVICE_CHOICES = 16  # muster0 .. muster15 tried when no name is given


def claim_device(name: str | None = None) -> tuple[str, socket.socket]:
    """Claim a device name for this agent in this network namespace, where device names
    live: ``name``, or the first free of muster0, muster1, ... Two agents on one host so
    never take (or remove) each other's device. The claim is an abstract Unix socket
    (scoped to the network namespace, gone when the agent dies, even killed): keep the
    returned socket open for as long as the name is used. Raises UserError when
    ``name`` is taken, or every choice is (UserError: the fix is the --device flag)."""
    names = [name] if name else [f"muster{i}" for i in range(DEVICE_CHOICES)]
    for candidate in names:
        if not DEVICE_NAME.match(candidate) or candidate in (".", ".."):
            raise UserError(
                f"--device {candidate!r}: an interface name is 1-15 letters, digits, '_.-'"
            )
        if foreign_interface(candidate):
            if name:
                raise UserError(
                    f"--device {name}: this host has an interface of that name that muster "
                    "did not make; pick a name no interface has"
                )
            continue
        claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            claim.bind(f"\0muster-device:{candidate}")
        except OSError:
            claim.close()
            continue
        return candidate, claim
    if name:
        raise UserError(
            f"device {name} is used by another muster agent on this host: give this agent "
            "another --device name (or leave it out to take a free one)"
        )
    raise UserError(
        f"every device name muster0..muster{DEVICE_CHOICES - 1} is used by another muster "
        "agent on this host: give this agent --device NAME"
    )


DEVICE_ALIAS = "muster"  # the interface alias (ifalias) muster gives every device it makes
SYS_NET = Path("/sys/class/net")


def foreign_interface(name: str, sys_net: Path = SYS_NET) -> bool:
    """Whether ``name`` is an interface here that muster did not make (it carries no muster
    alias): someone else's (a VPN's wg0, tailscale0, eth0), which muster never removes."""
    where = sys_net / name
    if not where.exists():
        return False
    try:
        return not (where / "ifalias").read_text().startswith(DEVICE_ALIAS)
    except OSError:
        return True


@dataclass(frozen=True)
class Peer:
    public_key: str  # base64, as wg writes it
    endpoint: str  # host:port where its device listens
    address: str  # its mesh address (allowed-ips /32)


def keypair() -> tuple[str, str]:
    """A fresh (private, public) X25519 key pair, base64 as ``wg`` reads and writes them."""
    private = X25519PrivateKey.generate()
    raw = private.private_bytes(
        serialization.Encoding.Raw,
        serialization.PrivateFormat.Raw,
        serialization.NoEncryption(),
    )
    public = private.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    return base64.b64encode(raw).decode(), base64.b64encode(public).decode()


def has_cap_net_admin() -> bool:
    """This process may configure network devices (effective CAP_NET_ADMIN)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_NET_ADMIN & 1)
    except OSError:
        pass
    return False


def kernel_wireguard() -> bool:
    return Path("/sys/module/wireguard").exists()


def device_unavailable() -> str | None:
    """Why this host cannot make a WireGuard device, or None when it can."""
    if not has_cap_net_admin():
        return "no CAP_NET_ADMIN (a container without it cannot make a network device)"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    if shutil.which("wg") is None:
        return "`wg` (wireguard-tools) is not installed"
    if not kernel_wireguard():
        if shutil.which("wireguard-go") is None:
            return "neither kernel WireGuard nor `wireguard-go` is available"
        if not Path("/dev/net/tun").exists():
            return "no /dev/net/tun (wireguard-go needs a TUN device)"
    return None


def _run(*args: str, input: str | None = None) -> str:
    try:
        done = subprocess.run(
            list(args),
            capture_output=True,
            text=True,
            input=input,
            timeout=COMMAND_TIMEOUT_S,
            env=_clean_env(),
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InfrastructureError(f"`{' '.join(args[:3])}` failed: {exc}") from exc
    if done.returncode != 0:
        raise InfrastructureError(
            f"`{' '.join(args[:4])}` failed ({done.returncode}): {done.stderr.strip()}"
        )
    return done.stdout


def interface_mtu(name: str) -> int | None:
    """The MTU of this host's interface ``name``; None when it has none such, or it is a
    loopback (it says nothing of the way to other hosts)."""
    stats = psutil.net_if_stats().get(name)
    if stats is None or stats.mtu <= 0 or name == "lo" or stats.mtu >= 65536:
        return None
    return int(stats.mtu)


def uplink_mtu(toward: str) -> int | None:
    """The MTU of the interface this host sends to ``toward`` (a name or an address)
    through; None when unknown, or when that is the loopback (a controller on this host says
    nothing of the way to the peers)."""
    try:
        family, _, _, _, where = socket.getaddrinfo(toward, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(where)  # (UDP: nothing is sent; the kernel picks a route)
            local = str(probe.getsockname()[0]).split("%")[0]
        for name, addrs in psutil.net_if_addrs().items():
            if any(a.address.split("%")[0] == local for a in addrs):
                stats = psutil.net_if_stats().get(name)
                if stats is None or stats.mtu <= 0 or ipaddress.ip_address(local).is_loopback:
                    return None
                return int(stats.mtu)
    except (OSError, ValueError, IndexError):
        return None
    return None


class Device:
    """The agent's device (``muster0`` unless it claimed another name, see
    :func:`claim_device`) for one member of one epoch; ``down`` removes every trace of it."""

    def __init__(self, name: str = MESH_INTERFACE, log_dir: Path | None = None) -> None:
        self.name = name
        self.log_dir = log_dir
        self.process: subprocess.Popen[bytes] | None = None
        self.public_key = ""
        self.port = 0
        self.mtu = 0

    def up(self, address: str, prefix: int, listen_port: int = 0, mtu: int = MESH_MTU) -> None:
        """Create the device with ``address/prefix``, a fresh key, listening on UDP
        ``listen_port`` (0: a random one), at ``mtu``."""
        if foreign_interface(self.name):
            raise InfrastructureError(
                f"{self.name} is an interface of this host that muster did not make; muster "
                "does not touch it: give the agent another --device"
            )
        self.down()  # whatever an earlier epoch (or a crashed agent) left
        private, self.public_key = keypair()
        if kernel_wireguard():
            _run("ip", "link", "add", self.name, "type", "wireguard")
        else:
            self._start_wireguard_go()
        try:
            # Marked as muster's at once: only a device with the mark is ever removed.
            _run("ip", "link", "set", "dev", self.name, "alias", DEVICE_ALIAS)
            # The private key goes in on stdin: never on a command line, never in a file.
            _run("wg", "set", self.name, "private-key", "/dev/stdin",
                 "listen-port", str(listen_port), input=private + "\n")  # fmt: skip
            self.port = int(_run("wg", "show", self.name, "listen-port").strip())
            _run("ip", "address", "add", f"{address}/{prefix}", "dev", self.name)
            _run("ip", "link", "set", self.name, "mtu", str(mtu), "up")
            self.mtu = mtu
        except BaseException:
            self.down(made=True)
            raise

    def _start_wireguard_go(self) -> None:
        log: IO[bytes] | None = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log = open(self.log_dir / "wireguard-go.log", "ab")  # noqa: SIM115 - the child's
        try:
            self.process = subprocess.Popen(
                ["wireguard-go", self.name],
                env={**_clean_env(), "WG_PROCESS_FOREGROUND": "1"},
                stdin=subprocess.DEVNULL,
                stdout=log if log is not None else subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
        finally:
            if log is not None:
                log.close()
        socket = WG_SOCKETS / f"{self.name}.sock"
        deadline = time.monotonic() + START_TIMEOUT_S
        while not socket.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.down(made=True)
                raise InfrastructureError(
                    f"wireguard-go did not create {self.name} within {START_TIMEOUT_S:.0f}s"
                )
            time.sleep(0.02)

    def set_peers(self, peers: Sequence[Peer]) -> None:
        for peer in peers:
            _run("wg", "set", self.name, "peer", peer.public_key, "endpoint", peer.endpoint,
                 "allowed-ips", f"{peer.address}/32",
                 "persistent-keepalive", str(KEEPALIVE_S))  # fmt: skip

    def set_endpoint(self, public_key: str, endpoint: str) -> None:
        """Send the peer's packets to ``endpoint`` from now on (the relays' fallback)."""
        _run("wg", "set", self.name, "peer", public_key, "endpoint", endpoint)

    def handshakes(self) -> dict[str, float]:
        """Peer public key -> seconds since the epoch of its latest handshake (0: none)."""
        out = _run("wg", "show", self.name, "latest-handshakes")
        return {key: float(when) for key, when in (line.split() for line in out.splitlines())}

    def received(self) -> dict[str, int]:
        """Peer public key -> bytes received from it so far."""
        out = _run("wg", "show", self.name, "transfer")
        return {parts[0]: int(parts[1]) for parts in (line.split() for line in out.splitlines())}

    def endpoints(self) -> dict[str, str]:
        """Peer public key -> the UDP endpoint WireGuard last heard it from ("(none)": never)."""
        out = _run("wg", "show", self.name, "endpoints")
        return {key: where for key, where in (line.split() for line in out.splitlines())}

    def down(self, *, made: bool = False) -> None:
        """Remove the device (and so wireguard-go); never raises. An interface of that name
        muster did not make (no muster alias; ``made``: this call's own, not yet marked) is
        never removed."""
        with contextlib.suppress(Exception):
            exists = (SYS_NET / self.name).exists()
            if exists and (made or not foreign_interface(self.name)):
                _run("ip", "link", "delete", self.name)
        if self.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(5)
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait(5)
            self.process = None
        with contextlib.suppress(OSError):
            (WG_SOCKETS / f"{self.name}.sock").unlink(missing_ok=True)
        self.public_key, self.port = "", 0


def _die_with_parent() -> None:
    """In the child: SIGTERM when the agent dies, even by SIGKILL (Linux prctl). Linux sends
    it when the thread that started the child ends: the agent starts it from its default
    executor's threads, which live as long as the agent."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _clean_env() -> dict[str, str]:
    """No MUSTER_* (the join secret) reaches wireguard-go."""
    return {k: v for k, v in os.environ.items() if not k.startswith("MUSTER_")}
