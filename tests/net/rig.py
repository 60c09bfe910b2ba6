"""The multi-host rig: hosts made of Linux network namespaces, for every network test.

Each host is a network namespace with its own mount namespace (held by one long-lived
process; commands enter both with ``nsenter``), so wireguard-go's control sockets under
/run/wireguard and each host's /etc/hosts and /etc/resolv.conf are its own. Hosts hang on
switches (a Linux bridge in a namespace of its own), so the rig never adds a device to the
namespace it was started from. Three shapes, as seed 000 meets them:

- ``one_region``: every host on one switch (one provider region, one private network);
- ``two_regions``: two switches joined by a router namespace (routed, not one L2 network);
- ``behind_nats``: each host alone behind its own NAT router (nftables masquerade, unsolicited
  inbound dropped as home routers do) on a shared "internet" switch: no host reaches another
  host's address, every host reaches the controller.

The controller is a host too (``ctl``), on the region switch or on the internet, so agents
reach it over the rig's own network. A host may be "container-only": no /dev/net/tun and no
CAP_NET_ADMIN, like a container offering.

Everything is torn down by ``close`` (also at interpreter exit, and namespaces left by a run
that died are swept by the next). Addresses are the rig's own (10.77.x.x, 192.168.x.x and
TEST-NET-3 203.0.113.0/24), inside namespaces the rig made: nothing leaves the machine.

Run by hand (root):

    .venv/bin/python -m tests.net.rig --shape behind_nats --hosts 2

starts the controller and an agent on each host, prints how to enter each host, and tears
everything down on Enter or Ctrl-C.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import hashlib
import json
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from muster.net import firewall

NS_PREFIX = "mr"  # namespaces are named mr<pid>-<name>: the pid says whose they are
NETNS_ETC = Path("/etc/netns")
CONTROLLER_PORT = 7070
START_TIMEOUT_S = 60.0
WAN_NET = "203.0.113"  # TEST-NET-3: documentation addresses, routed only inside the rig


class RigUnavailable(RuntimeError):
    """Namespaces cannot be made here; the message says why (tests skip with it)."""


def why_unavailable() -> str | None:
    """Why this machine cannot build the rig, or None when it can."""
    if sys.platform != "linux":
        return "the network rig needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the network rig needs root to create network namespaces"
    for tool, package in (
        ("ip", "iproute2"),
        ("nsenter", "util-linux"),
        ("unshare", "util-linux"),
        ("ping", "iputils-ping"),  # Rig.reaches: without it every reach reads as a failure
    ):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian package {package})"
    probe = f"{NS_PREFIX}{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def missing_tools(*tools: str) -> str | None:
    """Why a test that needs ``tools`` (nft, wireguard-go, wg, iperf3) cannot run, or None."""
    packages = {"nft": "nftables", "wg": "wireguard-tools", "wireguard-go": "wireguard-go"}
    gone = [t for t in tools if shutil.which(t) is None]
    if not gone:
        return None
    names = " ".join(sorted({packages.get(t, t) for t in gone}))
    return f"{', '.join(gone)} not installed (apt-get install --no-install-recommends {names})"


def sh(*args: str, input: str | None = None, check: bool = True) -> str:
    done = subprocess.run(list(args), capture_output=True, text=True, input=input, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{shlex.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


@dataclass
class Host:
    """One machine of the rig."""

    name: str
    ns: str
    root: Path  # this host's own directory (data dir, work dir, logs)
    container_only: bool = False
    private_network: str | None = None  # its agent's --private-network
    holder: subprocess.Popen[bytes] | None = None
    addresses: dict[str, str] = field(default_factory=dict)  # interface -> IPv4 address

    @property
    def address(self) -> str:
        """The host's first address (what its peers and the controller see it by)."""
        return next(iter(self.addresses.values()))

    def argv(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` as run on this host: its network and mount namespaces, and for a
        container-only host without CAP_NET_ADMIN."""
        assert self.holder is not None, f"host {self.name} is not up"
        enter = ["nsenter", f"--target={self.holder.pid}", "--mount", "--net", "--"]
        if self.container_only:
            enter += ["setpriv", "--inh-caps=-net_admin", "--bounding-set=-net_admin", "--"]
        return [*enter, *cmd]


@dataclass
class Switch:
    name: str
    ns: str
    subnet: str  # "10.77.0": hosts get .11, .12, ...; routers .1
    ports: int = 0


class Rig:
    """Hosts, switches and routers; use as a context manager (or call ``close``)."""

    def __init__(self, root: Path | None = None) -> None:
        reason = why_unavailable()
        if reason:
            raise RigUnavailable(reason)
        sweep_stale()
        self.tag = f"{NS_PREFIX}{os.getpid()}"
        self._tmp = None if root else tempfile.TemporaryDirectory(prefix="muster-rig-")
        self.root = root or Path(self._tmp.name)  # type: ignore[union-attr]
        self.hosts: dict[str, Host] = {}
        self.switches: dict[str, Switch] = {}
        self.routers: list[str] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self._shells: dict[tuple[str, str, str], subprocess.Popen[str]] = {}
        self._asked = 0  # rig.api's requests, each with its number
        self.api_token = ""
        self.join_token = ""
        self.controller: Host | None = None
        atexit.register(self.close)

    def __enter__(self) -> Rig:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # ---- building ------------------------------------------------------------------------

    def _netns(self, name: str) -> str:
        ns = f"{self.tag}-{name}"
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        return ns

    def add_switch(self, name: str, subnet: str) -> Switch:
        ns = self._netns(f"sw-{name}")
        sh("ip", "-n", ns, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", ns, "link", "set", "br0", "up")
        switch = self.switches[name] = Switch(name, ns, subnet)
        return switch

    def add_host(self, name: str, *, container_only: bool = False) -> Host:
        ns = self._netns(name)
        root = self.root / name
        root.mkdir(parents=True, exist_ok=True)
        etc = NETNS_ETC / ns
        etc.mkdir(parents=True, exist_ok=True)
        # A resolver that answers at once (nothing listens): torch's c10d reverse-resolves
        # peers, and an unreachable resolver stalls every rank ~5 s.
        (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        (etc / "hosts").write_text("127.0.0.1 localhost\n")
        Path("/run/wireguard").mkdir(parents=True, exist_ok=True)
        hide_tun = "mount -t tmpfs -o mode=0755 rig-no-tun /dev/net && " if container_only else ""
        # `ip netns exec` binds /etc/netns/<ns>/* over /etc; unshare gives the host a mount
        # namespace of its own, with its own /run/wireguard; the shell then waits forever.
        # `ip netns exec` gave it a fresh /sys; the cgroup v2 hierarchy goes where a modern
        # host has it (the agent puts each member's ranks in a group of their own there).
        script = (
            "mount --make-rprivate / && "
            "mount -t tmpfs -o mode=0755 rig-wireguard /run/wireguard && "
            "{ mount -t cgroup2 rig-cgroup2 /sys/fs/cgroup || true; } && "
            f"{hide_tun}echo up && exec sleep infinity"
        )
        holder = subprocess.Popen(
            ["ip", "netns", "exec", ns, "unshare", "--mount", "sh", "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        assert holder.stdout is not None
        if holder.stdout.readline().strip() != b"up":
            holder.kill()
            _, err = holder.communicate(timeout=5)
            raise RigUnavailable(f"host {name}: its mount namespace: {err.decode().strip()}")
        host = self.hosts[name] = Host(name, ns, root, container_only, holder=holder)
        return host

    def plug(self, host: Host, switch: Switch, *, ifname: str = "eth0", last: int = 0) -> str:
        """Wire ``host`` to ``switch``; returns its address on it (``subnet.last``)."""
        switch.ports += 1
        last = last or 10 + switch.ports
        address = f"{switch.subnet}.{last}"
        port = f"p{switch.ports}"
        sh("ip", "link", "add", ifname, "netns", host.ns, "type", "veth",
           "peer", "name", port, "netns", switch.ns)  # fmt: skip
        sh("ip", "-n", switch.ns, "link", "set", port, "master", "br0", "up")
        sh("ip", "-n", host.ns, "addr", "add", f"{address}/24", "dev", ifname)
        sh("ip", "-n", host.ns, "link", "set", ifname, "up")
        host.addresses[ifname] = address
        self._write_hosts()
        return address

    def route(self, host: Host, via: str, to: str = "default") -> None:
        sh("ip", "-n", host.ns, "route", "replace", to, "via", via)

    def add_router(self, name: str, *legs: tuple[Switch, str]) -> Host:
        """A router namespace with one interface per (switch, ifname), at .1 on each, and
        IPv4 forwarding on."""
        router = self.add_host(name)
        for switch, ifname in legs:
            self.plug(router, switch, ifname=ifname, last=1)
        sh("ip", "netns", "exec", router.ns, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        self.routers.append(name)
        return router

    def add_nat(self, name: str, host: Host, wan: Switch, index: int) -> Host:
        """Put ``host`` alone behind a NAT router on ``wan``: masquerade out, and nothing
        in that the host did not open, to the host or to the router itself (as a home
        router: a stray inbound datagram that the router took for itself would leave a
        conntrack entry that makes masquerade map the host's port elsewhere). Needs nftables."""
        why = missing_tools("nft")
        if why:
            raise RigUnavailable(why)
        lan = self.add_switch(f"lan{index}", f"192.168.{index}")
        router = self.add_router(name, (lan, "lan0"))
        self.plug(router, wan, ifname="wan0", last=100 + index)
        self.plug(host, lan)
        self.route(host, f"192.168.{index}.1")
        ruleset = """
table ip muster_rig_nat {
  chain postrouting { type nat hook postrouting priority srcnat; oifname "wan0" masquerade; }
  chain forward {
    type filter hook forward priority filter; policy drop;
    ct state established,related accept
    iifname "lan0" oifname "wan0" accept
  }
  chain input {
    type filter hook input priority filter; policy accept;
    iifname "wan0" ct state new drop
  }
}
"""
        sh("ip", "netns", "exec", router.ns, "nft", "-f", "-", input=ruleset)
        return router

    def _write_hosts(self) -> None:
        lines = ["127.0.0.1 localhost"]
        for host in self.hosts.values():
            if host.addresses and host.name not in self.routers:
                lines.append(f"{host.address} {host.name}")
        for host in self.hosts.values():
            (NETNS_ETC / host.ns / "hosts").write_text("\n".join(lines) + "\n")

    # ---- the shapes ----------------------------------------------------------------------

    def one_region(self, count: int, *, container_only: Sequence[str] = ()) -> list[Host]:
        """``count`` hosts h1..hN and the controller host ctl on one switch (10.77.0.0/24),
        their agents declaring one private network (``--private-network region``)."""
        region = self.add_switch("region", "10.77.0")
        self.plug(self.add_host("ctl"), region, last=2)
        hosts = []
        for i in range(1, count + 1):
            host = self.add_host(f"h{i}", container_only=f"h{i}" in container_only)
            host.private_network = "region"
            self.plug(host, region)
            hosts.append(host)
        return hosts

    def two_regions(self, count: int, *, container_only: Sequence[str] = ()) -> list[Host]:
        """Hosts alternately on 10.77.1.0/24 and 10.77.2.0/24, a router between; ctl on
        the first."""
        a, b = self.add_switch("a", "10.77.1"), self.add_switch("b", "10.77.2")
        self.add_router("r1", (a, "a0"), (b, "b0"))
        ctl = self.add_host("ctl")
        self.plug(ctl, a, last=2)
        self.route(ctl, "10.77.1.1")
        hosts = []
        for i in range(1, count + 1):
            host = self.add_host(f"h{i}", container_only=f"h{i}" in container_only)
            switch = a if i % 2 else b
            self.plug(host, switch)
            self.route(host, f"{switch.subnet}.1")
            hosts.append(host)
        return hosts

    def behind_nats(self, count: int, public: int = 0) -> list[Host]:
        """Each host hN alone behind NAT router natN (192.168.N.0/24 inside); routers and
        ctl on the internet switch (203.0.113.0/24), and ``public`` more hosts on it with
        public addresses of their own (no NAT)."""
        wan = self.add_switch("wan", WAN_NET)
        self.plug(self.add_host("ctl"), wan, last=2)
        hosts = []
        for i in range(1, count + 1):
            host = self.add_host(f"h{i}")
            self.add_nat(f"nat{i}", host, wan, i)
            hosts.append(host)
        for i in range(count + 1, count + public + 1):
            host = self.add_host(f"h{i}")
            self.plug(host, wan, last=200 + i)
            hosts.append(host)
        return hosts

    # ---- running things ------------------------------------------------------------------

    def run(
        self,
        host: Host,
        *cmd: str,
        check: bool = True,
        timeout: float = 30,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            host.argv(cmd),
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **(env or {})},
            stdin=subprocess.DEVNULL,
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"on {host.name}: {shlex.join(cmd)} exited {done.returncode}: "
                f"{done.stderr.strip() or done.stdout.strip()}"
            )
        return done

    def spawn(
        self, host: Host, name: str, *cmd: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start a long-running process on ``host``; its output goes to ``log(host, name)``."""
        with open(self.log(host, name), "ab") as out:
            proc = subprocess.Popen(
                host.argv(cmd),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**self._muster_env(host), **(env or {})},
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def nft(self, host: Host, ruleset: str) -> None:
        """Load an nftables ruleset on ``host`` (``nft -f -``)."""
        sh(*host.argv(["nft", "-f", "-"]), input=ruleset)

    def log(self, host: Host, name: str) -> Path:
        return host.root / f"{name}.log"

    def reaches(self, host: Host, address: str, timeout: float = 1.0) -> bool:
        """A ping from ``host`` to ``address`` comes back: pings every 0.2 s until one does,
        for at least 2 s (a busy machine may lose the first)."""
        wait = str(max(2, int(timeout)))
        done = self.run(host, "ping", "-c1", "-i", "0.2", "-w", wait, address, check=False)
        return done.returncode == 0

    # ---- muster on the rig ---------------------------------------------------------------

    def _muster_env(self, host: Host) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MUSTER_")}
        env["MUSTER_DATA_DIR"] = str(host.root / "data")
        return env

    def muster(self, host: Host, *args: str, timeout: float = 60) -> str:
        """The muster CLI on ``host``, as a user holding the API token; returns stdout."""
        return self.muster_python(host, "-m", "muster", *args, timeout=timeout)

    @property
    def controller_url(self) -> str:
        assert self.controller is not None
        return f"https://{self.controller.address}:{CONTROLLER_PORT}"

    def start_controller(self, host: Host, *args: str) -> None:
        """``muster server`` on ``host``'s address (TLS, as off loopback it must be)."""
        self.spawn(
            host, "server", sys.executable, "-m", "muster", "server",
            "--host", host.address, "--port", str(CONTROLLER_PORT), *args,
        )  # fmt: skip
        self.controller = host
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            probe = self.run(
                host, "python3", "-c",
                "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 1)",
                host.address, str(CONTROLLER_PORT), check=False,
            )  # fmt: skip
            if probe.returncode == 0:
                break
            time.sleep(0.2)
        else:
            raise RuntimeError(f"the controller did not start; see {self.log(host, 'server')}")
        env = self._muster_env(host)
        for flag, attr in (("--api", "api_token"), ("", "join_token")):
            cmd = [sys.executable, "-m", "muster", "token", *([flag] if flag else [])]
            done = subprocess.run(
                host.argv(cmd), capture_output=True, text=True, env=env, timeout=60, check=True
            )
            setattr(self, attr, done.stdout.strip())

    def start_agent(
        self, host: Host, *args: str, worker: str | None = None
    ) -> subprocess.Popen[bytes]:
        """``muster agent`` on ``host`` (worker id ``worker``, by default the host's name: a
        host may run several), dialling the rig's controller; the join string goes in
        MUSTER_TOKEN, never on the command line."""
        assert self.join_token, "start the controller first"
        worker = worker or host.name
        suffix = "" if worker == host.name else f"-{worker}"
        return self.spawn(
            host, f"agent{suffix}", sys.executable, "-m", "muster", "agent",
            "--controller", self.controller_url, "--name", worker,
            "--work-dir", str(self.work_dir(host, worker)),
            *(["--private-network", host.private_network] if host.private_network else []),
            *args,
            env={"MUSTER_TOKEN": self.join_token},
        )  # fmt: skip

    @staticmethod
    def work_dir(host: Host, worker: str | None = None) -> Path:
        """The work dir of ``worker``'s agent on ``host`` (by default the host's name)."""
        worker = worker or host.name
        return host.root / ("work" if worker == host.name else f"work-{worker}")

    def agent_key(self, host: Host, worker: str | None = None) -> str:
        """What names that agent's nftables table and rank groups (``firewall.agent_key``)."""
        return firewall.agent_key(worker or host.name, self.work_dir(host, worker))

    def api(self, method: str, *args: str, host: Host | None = None, timeout: float = 60) -> Any:
        """``muster.client.Client().<method>(*args)`` called on ``host`` (the controller's
        by default) with the API token; returns its JSON answer.

        The call goes to one Python per host and controller that serves them all: a Python
        started per call, importing muster, cost ~0.4 s of CPU, and tests that poll took it
        from the ranks they watch. Each request carries an id its answer echoes; a shell that
        dies, stalls or answers out of turn is dropped (the next call starts another)."""
        where = host or self.controller
        assert where is not None
        shell = self._api_shell(where)
        assert shell.stdin is not None
        assert shell.stdout is not None
        self._asked += 1
        ask = self._asked
        line, answer = "", None
        try:
            shell.stdin.write(json.dumps([ask, method, list(args)]) + "\n")
            shell.stdin.flush()
            # (select sees the pipe, not the reader's buffer: nothing is ever left there,
            # as the shell answers one line per request and the last one was read whole)
            ready, _, _ = select.select([shell.stdout], [], [], timeout)
            line = shell.stdout.readline() if ready else ""
            answer = json.loads(line) if line.endswith("\n") else None
        except BaseException:
            self._drop_api_shell(shell)  # interrupted mid-exchange: it may answer late
            raise
        if not isinstance(answer, dict) or answer.get("ask") != ask:
            code = shell.poll()
            self._drop_api_shell(shell)
            what = (
                f"its API shell exited ({code})"
                if code is not None
                else f"no answer within {timeout:.0f}s"
                if not line
                else f"an answer out of turn: {line[:200]!r}"
            )
            raise AssertionError(
                f"on {where.name}: Client().{method}{args}: {what}\n{self.log_tails()}"
            )
        if "error" in answer:
            raise AssertionError(f"on {where.name}: Client().{method}{args}: {answer['error']}")
        return answer["ok"]

    def _api_shell(self, host: Host) -> subprocess.Popen[str]:
        env = {**self._muster_env(host), "MUSTER_API_TOKEN": self.api_token}
        if self.controller is not None:
            env["MUSTER_CONTROLLER"] = self.controller_url
        key = (host.name, env.get("MUSTER_CONTROLLER", ""), self.api_token)
        shell = self._shells.get(key)
        if shell is not None and shell.poll() is None:
            return shell
        for old_key in [k for k in self._shells if k[0] == host.name]:
            self._drop_api_shell(self._shells[old_key])  # dead, or for another controller
        with open(self.log(host, "api-shell"), "ab") as errors:
            shell = subprocess.Popen(
                host.argv([sys.executable, "-c", API_SHELL]),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=errors,
                text=True,
                env=env,
                start_new_session=True,
            )
        self._shells[key] = shell
        return shell

    def _drop_api_shell(self, shell: subprocess.Popen[str]) -> None:
        for key, known in list(self._shells.items()):
            if known is shell:
                del self._shells[key]
        for pipe in (shell.stdin, shell.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            shell.wait(2)  # (its stdin closed: it ends by itself)
        _kill_group(shell, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            shell.wait(5)

    def muster_python(self, host: Host, *args: str, timeout: float = 60) -> str:
        env = {**self._muster_env(host), "MUSTER_API_TOKEN": self.api_token}
        if self.controller is not None:
            env["MUSTER_CONTROLLER"] = self.controller_url
        done = subprocess.run(
            host.argv([sys.executable, *args]),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            stdin=subprocess.DEVNULL,
        )
        if done.returncode != 0:
            raise AssertionError(f"on {host.name}: python {shlex.join(args)}: {done.stderr}")
        return done.stdout

    def start_cluster(self, hosts: Sequence[Host], *agent_args: str) -> Host:
        """The controller on the rig's ``ctl`` host and an agent (with ``agent_args``) on each
        of ``hosts``, all connected and idle; returns the controller's host."""
        ctl = self.hosts["ctl"]
        self.start_controller(ctl)
        for host in hosts:
            self.start_agent(host, *agent_args)
        self.wait_for_workers([h.name for h in hosts])
        return ctl

    def wait_done(self, job_id: str, timeout: float = 180, poll: float = 0.5) -> dict[str, Any]:
        """The job once it is over (bounded); its events in the message if it is not. Asked
        every ``poll`` seconds (each answer costs the rig's controller a few ms of CPU on
        the cores the ranks use: a benchmark asks less often)."""
        deadline = time.monotonic() + timeout
        job: dict[str, Any] = self.api("job", job_id)
        while job["state"] not in ("succeeded", "failed", "cancelled"):
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{job_id} still {job['state']}: {job['events']}\n{self.log_tails()}"
                )
            time.sleep(poll)
            job = self.api("job", job_id)
        return job

    def log_tails(self, lines: int = 25) -> str:
        """The last lines of every log on the rig (agents, controller, wireguard-go): what a
        failed test's message carries, so a CI failure explains itself."""
        out = []
        for path in sorted(self.root.rglob("*.log")):
            try:
                tail = path.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            out.append(f"--- {path.relative_to(self.root)} ---\n" + "\n".join(tail))
        return "\n".join(out)

    def wait_for_workers(self, names: Sequence[str], timeout: float = 90) -> None:
        """Until every worker in ``names`` is connected and idle (bounded)."""
        deadline = time.monotonic() + timeout
        seen: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            seen = self.api("workers")
            idle = {w["id"] for w in seen if w["connected"] and w["state"] == "idle"}
            if set(names) <= idle:
                return
            time.sleep(0.5)
        raise AssertionError(f"workers {sorted(names)} did not all connect idle: {seen}")

    # ---- teardown ------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every process and remove every namespace the rig made. Never raises."""
        for shell in list(self._shells.values()):
            with contextlib.suppress(OSError):
                self._drop_api_shell(shell)
        for proc in self.procs:
            _kill_group(proc, signal.SIGTERM)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            _kill_group(proc, signal.SIGKILL)
        self.procs.clear()
        for host in list(self.hosts.values()):
            if host.holder is not None:
                _kill_group(host.holder, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    host.holder.wait(5)
        for ns in self._namespaces():
            _remove_namespace(ns)
        self.hosts.clear()
        self.switches.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def _namespaces(self) -> list[str]:
        return [ns for ns in list_namespaces() if ns.startswith(f"{self.tag}-")]


# One Python per host that serves rig.api: a line [ask, method, [args]] in, a line
# {"ask": ask, "ok": answer} or {"ask": ask, "error": why} out, on a descriptor of its own
# (anything printed to stdout goes to stderr). One Client while it works, a new one after
# any error (the controller may have restarted).
API_SHELL = """
import contextlib, json, os, sys
answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
from muster.client import Client
client = None
for line in sys.stdin:
    ask, method, args = json.loads(line)
    try:
        client = client or Client()
        text = json.dumps({"ask": ask, "ok": getattr(client, method)(*args)})
    except Exception as exc:
        text = json.dumps({"ask": ask, "error": f"{type(exc).__name__}: {exc}"})
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
        client = None
    answers.write(text + "\\n")
    answers.flush()
"""


def _kill_group(proc: subprocess.Popen[Any], sig: int) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)


def list_namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _remove_namespace(ns: str) -> None:
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    for pid in pids.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


def sweep_stale() -> None:
    """Remove the namespaces of rigs whose process is gone (a run that was killed)."""
    for ns in list_namespaces():
        found = re.fullmatch(rf"{NS_PREFIX}(\d+)-.+", ns)
        if found and not _alive(int(found.group(1))):
            _remove_namespace(ns)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def rig_with_agents(shape: str, hosts: int) -> Iterator[Rig]:
    with Rig() as rig:
        rig.start_cluster(getattr(rig, shape)(hosts))
        yield rig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=["one_region", "two_regions", "behind_nats"],
                        default="one_region")  # fmt: skip
    parser.add_argument("--hosts", type=int, default=2)
    opts = parser.parse_args()
    with rig_with_agents(opts.shape, opts.hosts) as rig:
        token_file = rig.root / "api-token"
        token_file.write_text(rig.api_token + "\n")
        token_file.chmod(0o600)
        print(f"controller: {rig.controller_url}")
        for host in rig.hosts.values():
            print(f"{host.name:6} {host.ns:20} {' '.join(host.addresses.values()):30} "
                  f"enter: nsenter --target={host.holder.pid if host.holder else '?'} "
                  "--mount --net bash")  # fmt: skip
        print(f"in a host: muster get workers -c {rig.controller_url} --token-file {token_file}")
        print("logs under", rig.root, "- press Enter (or Ctrl-C) to tear everything down")
        with contextlib.suppress(KeyboardInterrupt, EOFError):
            input()


if __name__ == "__main__":
    main()


def rank_group(key: str, job_id: str) -> str:
    """The cgroup (directory, as a rig host mounts the hierarchy) that the agent of ``key``
    (``Rig.agent_key``) made for its member of ``job_id``: muster.net.cgroup's naming."""
    prefix = "muster-" + hashlib.sha256(key.encode()).hexdigest()[:12] + "-"
    return f"/sys/fs/cgroup/{prefix}{firewall.gang_name(job_id)}"
