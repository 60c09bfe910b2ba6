"""Did NCCL use the fabric? Read NCCL's output and give a verdict (seed 004, "Verifying").

NCCL prints ``host:pid:tid [dev] NCCL INFO Using network <name>`` once per rank at init, at
NCCL_DEBUG=INFO and above. The name says it all: ``FasTrak`` (GKE TCPXO), ``AWS Libfabric``
(EFA) and ``IB`` (InfiniBand) mean attached; ``Socket`` means NCCL fell back to TCP. Lines may
carry a ``kubectl logs --prefix`` tag (``[pod/NAME/CONTAINER]``) or muster's (``[rank3]``).

No banner is never a fallback: it is inconclusive, with the likely reason (NCCL_DEBUG below
INFO, as every AICR runtime sets WARN; output cut short; or an MPI launcher printing the ranks'
output in its own pod).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from muster.k8s.fabric import BANNER, Fabric

Verdict = Literal["attached", "fallback", "inconclusive", "other fabric"]
# 5: NCCL attached to a fabric, but not the one expected (--fabric): not "attached". (2 is
# a usage error, 4 an unreachable cluster, as for every muster command.)
EXIT_CODES: dict[Verdict, int] = {
    "attached": 0,
    "fallback": 1,
    "inconclusive": 3,
    "other fabric": 5,
}

_PREFIX = re.compile(
    r"^\[(?:pod/(?P<pod>[^/\]]+)/(?P<container>[^\]]+)|(?P<tag>(?:rank|node)\d+))\]\s?"
)
_NCCL = re.compile(
    r"(?P<host>[^\s:]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\] NCCL (?P<level>INFO|WARN|TRACE)"
    r" (?P<message>.*)$"
)
_BANNER = re.compile(r"^Using network (?P<network>.+?)\s*$")
_EVIDENCE = re.compile(r"No device found|[Ff]ailed to|[Ee]rror|could not|not found", re.I)

CAUSES: dict[str, str] = {
    "tcpxo": (
        "the TCPXO plugin did not load: check that the pod runs the tcpxo-daemon sidecar, "
        "mounts the plugin (/usr/local/nvidia) with LD_LIBRARY_PATH pointing at it, carries "
        "the eight gpu-nic interface annotations, and that NCCL_FASTRAK_* reach the worker "
        "(`muster k8s render --fabric tcpxo` writes all of it)"
    ),
    "efa": (
        "the image lacks libfabric / aws-ofi-nccl (or LD_LIBRARY_PATH does not reach it), the "
        "pod got no vpc.amazonaws.com/efa devices, IPC_LOCK is missing, or NCCL_SOCKET_IFNAME "
        "names the wrong interface"
    ),
    "ib": (
        "the image lacks rdma-core / libibverbs (NCCL then logs 'NET/IB : No device found'), "
        "the pod got no rdma/hca_shared_devices_a, IPC_LOCK is missing, or NCCL_SOCKET_IFNAME "
        "names the wrong interface"
    ),
}


@dataclass
class Rank:
    """One NCCL process, named by where its lines came from."""

    name: str
    network: str | None = None
    evidence: list[str] = field(default_factory=list)


@dataclass
class Report:
    verdict: Verdict
    summary: str
    ranks: list[Rank]
    cause: str | None = None

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]


def _attached(network: str) -> bool:
    return network.lower() != "socket"


def analyse(lines: Iterable[str], fabric: Fabric | None = None) -> Report:
    """The verdict for NCCL output, optionally for an expected fabric."""
    ranks: dict[str, Rank] = {}
    info = warn = total = 0
    for raw in lines:
        line = raw.rstrip("\n")
        total += 1
        source = None
        prefix = _PREFIX.match(line)
        if prefix:
            source = prefix["pod"] or prefix["tag"]
            line = line[prefix.end() :]
        nccl = _NCCL.search(line)
        if not nccl:
            continue
        info += nccl["level"] == "INFO"
        warn += nccl["level"] == "WARN"
        name = f"{source or nccl['host']} pid {nccl['pid']}"
        rank = ranks.setdefault(name, Rank(name))
        banner = _BANNER.match(nccl["message"])
        if banner:
            rank.network = banner["network"]
        elif _EVIDENCE.search(nccl["message"]):
            rank.evidence.append(nccl["message"])
    seen = [r for r in ranks.values() if r.network is not None]
    if not seen:
        return Report("inconclusive", _why_no_banner(total, info, warn), list(ranks.values()))
    fell_back = [r for r in seen if not _attached(r.network or "")]
    if fell_back:
        names = ", ".join(r.name for r in fell_back)
        cause = CAUSES.get(fabric or "") or "; or ".join(f"{f}: {c}" for f, c in CAUSES.items())
        found = sorted({e for r in fell_back for e in r.evidence})
        if found:
            cause += ". NCCL said: " + " | ".join(found[:3])
        return Report(
            "fallback",
            f"{len(fell_back)} of {len(seen)} rank(s) use network Socket (TCP): {names}",
            list(ranks.values()),
            cause,
        )
    networks = sorted({r.network or "" for r in seen})
    missing = [r.name for r in ranks.values() if r.network is None]
    if fabric in BANNER:
        names_of = {n.lower() for n in BANNER[fabric]}
        other = [r for r in seen if (r.network or "").lower() not in names_of]
        if other:
            names = ", ".join(f"{r.name} ({r.network})" for r in other)
            return Report(
                "other fabric",
                f"{len(other)} of {len(seen)} rank(s) attached to another network than "
                f"{' or '.join(BANNER[fabric])}, which {fabric} would show: {names}",
                list(ranks.values()),
                f"the pods ran on other nodes or another runtime than the {fabric} one: check "
                "the job's node selector and runtime (`muster k8s preflight`), or the --fabric "
                "you expected",
            )
    summary = f"{len(seen)} rank(s) attached to {', '.join(networks)}"
    if missing:
        summary += f"; no banner from {', '.join(missing)}"
    return Report("attached", summary, list(ranks.values()))


def _why_no_banner(total: int, info: int, warn: int) -> str:
    if total == 0:
        return "inconclusive: no output to read"
    if info == 0:
        extra = f" (saw {warn} NCCL WARN line(s))" if warn else ""
        return (
            "inconclusive: no NCCL INFO lines" + extra + ", so NCCL_DEBUG is below INFO (every "
            "AICR runtime sets WARN). Run a short job with NCCL_DEBUG=INFO "
            "(`muster k8s render --nccl-debug INFO`); absence of the banner is not a fallback"
        )
    return (
        "inconclusive: NCCL INFO lines but no 'Using network' banner. The output may be cut "
        "short (kubectl logs with a selector keeps 10 lines unless --tail=-1), or an MPI "
        "launcher printed the ranks' output in its own pod (read the launcher's logs: "
        "--replicated-job launcher)"
    )
