"""A gang's ports, open to its members only (nftables).

torchrun's c10d store on node 0 listens on every address of the host, and gloo and NCCL
listen on ephemeral ports of the path's interface. While a gang runs, its agent drops TCP
from any address that is not a member's (on the gang's path: private addresses, or mesh
addresses on the direct path) to node 0's rendezvous port and, where the ranks run in a
cgroup of their own (``muster.net.cgroup``), to every port their sockets listen on. Another
gang, or anyone else who reaches the host, can neither join the rendezvous nor connect to a
rank. Connections from the host's own loopback addresses reach a rank's sockets (gloo and
NCCL listen on the path's address; what a rank serves on loopback is the user's), never the
rendezvous port.

One table per agent, ``inet muster_<id>``: a set and rules per gang, all named after the
gang (``g<hash>``) and carrying the job and epoch in a comment. ``<id>`` digests the
agent's key (``agent_key``: its worker id and work dir), so two agents on one host, of one
cluster or of two, never touch each other's table. The agent sweeps its table when it starts
(a crashed agent's rules go) and deletes it when it stops. Rules are
changed with ``nft -f -`` (one transaction each); a host without nft or CAP_NET_ADMIN
gets no rules, and the agent says so once.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from muster.net.cgroup import RankGroup
from muster.net.probe import PROBE_MARK

NFT_TIMEOUT_S = 10.0


def agent_key(worker_id: str, work_dir: Path | str) -> str:
    """What names an agent's rules and rank groups on its host: its worker id alone is not
    enough (two clusters' agents on one host both default to the host's name, and each would
    sweep the other's), its work dir is its own. A restarted agent of the same work dir finds
    what its crashed self left."""
    return f"{worker_id}@{Path(work_dir).resolve()}"


def table_name(key: str) -> str:
    """The agent's table: ``muster_`` and a digest of its ``agent_key`` (nft names are short)."""
    return "muster_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def gang_name(job: str) -> str:
    return "g" + hashlib.sha256(job.encode()).hexdigest()[:12]


def _quote(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.:=-]", "_", text)[:100]


def unavailable() -> str | None:
    """Why this host cannot take rules (no nft, or no right to change them), or None."""
    if shutil.which("nft") is None:
        return "nft is not installed"
    try:
        done = subprocess.run(
            ["nft", "list", "tables"], capture_output=True, text=True, timeout=NFT_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nft does not run: {exc}"
    if done.returncode != 0:
        return (done.stderr.strip() or "nft list tables failed").splitlines()[0]
    return None


class Firewall:
    """One agent's table; every method runs nft (call them off the event loop)."""

    def __init__(self, key: str) -> None:
        self.table = table_name(key)
        self.gangs: dict[str, str] = {}  # job -> gang name (its set and its rule's comment)

    def _nft(self, script: str) -> None:
        done = subprocess.run(
            ["nft", "-f", "-"],
            input=script,
            capture_output=True,
            text=True,
            timeout=NFT_TIMEOUT_S,
        )
        if done.returncode != 0:
            raise RuntimeError(f"nft: {done.stderr.strip() or done.returncode}")

    def sweep(self) -> bool:
        """Remove this agent's table and everything in it (rules of a crashed run), when
        there is one; True when one was removed. Creates nothing."""
        self.gangs.clear()
        listed = subprocess.run(
            ["nft", "list", "tables", "inet"], capture_output=True, text=True, timeout=NFT_TIMEOUT_S
        )
        if f"table inet {self.table}" not in listed.stdout.split("\n"):
            return False
        self._nft(f"delete table inet {self.table}\n")
        return True

    def open(
        self,
        job: str,
        epoch: int,
        port: int | None,
        members: Sequence[str],
        ranks: RankGroup | None = None,
        mesh: str | None = None,
    ) -> None:
        """Drop TCP to ``port`` (node 0's rendezvous port) and new connections to any socket
        of the ``ranks`` group unless they come from one of ``members`` (addresses). With
        ``mesh`` (the gang's network on the direct path, a CIDR) and ``ranks``: drop new
        connections into that network from any socket of this host but the ranks' (and the
        agent's probe, by its mark), so another gang's ranks on a shared host cannot use
        this gang's device."""
        if job in self.gangs:
            self.close(job)
        name = gang_name(job)
        v4 = sorted({a for a in members if ipaddress.ip_address(a).version == 4})
        v6 = sorted({a for a in members if ipaddress.ip_address(a).version == 6})
        note = _quote(f"muster job {job} epoch {epoch}")
        lines = [
            f"table inet {self.table} {{",
            f'  set {name}4 {{ type ipv4_addr; comment "{note}"; '
            + (f"elements = {{ {', '.join(v4)} }}; " if v4 else "")
            + "}",
            f'  set {name}6 {{ type ipv6_addr; comment "{note}"; '
            + (f"elements = {{ {', '.join(v6)} }}; " if v6 else "")
            + "}",
            "  chain input { type filter hook input priority -5; policy accept; }",
            "  chain output { type filter hook output priority -5; policy accept; }",
            "}",
        ]
        matches = []  # (match, whether the host's own loopback addresses are let through)
        if port is not None:
            # The c10d store listens on every address, loopback too: nothing but the members
            # (its own node connects by its member address, like the others).
            matches.append((f"tcp dport {port}", False))
        if ranks is not None:
            # A connection's first packet, to a socket one of the gang's ranks opened. gloo and
            # NCCL listen on the path's address; what a rank serves on loopback (a user's own
            # helper) stays reachable from this host.
            matches.append(
                (
                    "tcp flags & (syn | ack) == syn "
                    f'socket cgroupv2 level {ranks.level} "{ranks.nft_path}"',
                    True,
                )
            )
        for match, loopback in matches:
            lines += [
                f"add rule inet {self.table} input meta nfproto ipv4 {match} "
                + ("ip saddr != 127.0.0.0/8 " if loopback else "")
                + f'ip saddr != @{name}4 counter drop comment "{name} {note}"',
                f"add rule inet {self.table} input meta nfproto ipv6 {match} "
                + ("ip6 saddr != ::1 " if loopback else "")
                + f'ip6 saddr != @{name}6 counter drop comment "{name} {note}"',
            ]
        if ranks is not None and mesh is not None:
            net = ipaddress.ip_network(mesh)
            family = "ip" if net.version == 4 else "ip6"
            lines.append(
                f"add rule inet {self.table} output meta nfproto ipv{net.version} "
                f"{family} daddr {net} tcp flags & (syn | ack) == syn "
                f"meta mark != {PROBE_MARK:#x} "
                f'socket cgroupv2 level {ranks.level} != "{ranks.nft_path}" '
                f'counter drop comment "{name} {note}"'
            )
        self._nft("\n".join(lines) + "\n")
        self.gangs[job] = name

    def close(self, job: str) -> None:
        """Remove the gang's rules and sets (nothing when it has none); with the last gang,
        the table."""
        name = self.gangs.pop(job, None)
        if name is None:
            return
        if not self.gangs:  # the last gang: nothing of muster's stays on the host
            self._nft(f"delete table inet {self.table}\n")
            return
        script = []
        for chain in ("input", "output"):
            listing = subprocess.run(
                ["nft", "-a", "list", "chain", "inet", self.table, chain],
                capture_output=True,
                text=True,
                timeout=NFT_TIMEOUT_S,
            ).stdout
            handles = re.findall(rf'comment "{name} [^"]*" # handle (\d+)', listing)
            script += [f"delete rule inet {self.table} {chain} handle {h}" for h in handles]
        script += [f"delete set inet {self.table} {name}4", f"delete set inet {self.table} {name}6"]
        self._nft("\n".join(script) + "\n")
