"""What a member frame from an agent says, read into the lifecycle's event for it.

The controller checks the frame belongs to the run's current epoch and node, and does
what is not the run's (join keys, relay tickets); this module reads the body. A malformed
body raises KeyError, TypeError or ValueError, which the controller counts and skips:
nothing an agent sends reaches the run unread.
"""

from __future__ import annotations

import base64
import ipaddress
from typing import Any

from muster.controller.runs import RunEntry
from muster.gang import (
    Event,
    MasterChecked,
    MemberExited,
    MemberHung,
    MemberReport,
    MemberStarted,
    NetPath,
    NetReady,
    NetUp,
    OutputsStored,
    PortPublished,
    ProbeDone,
    ProbePair,
    ProbeReady,
)
from muster.plan import MESH_MTU, MESH_MTU_REGION, mesh_address
from muster.spec import MESH_INTERFACE, PathClass
from muster.wire import Kind


def member_event(entry: RunEntry, node: int, kind: Kind, body: dict[str, Any]) -> Event | None:
    """The event member ``node``'s frame of ``kind`` stands for; None for a kind that is no
    event of the run (RELAY_TICKETS and the like)."""
    if kind is Kind.NET_READY:
        return net_ready(entry, node, body)
    if kind is Kind.NET_UP:
        return NetUp(node)
    if kind is Kind.PROBE_READY:
        error = body.get("error")
        return ProbeReady(node, int(body.get("port") or 0), str(error)[:500] if error else None)
    if kind is Kind.PROBE_DONE:
        pairs = tuple(_probe_pair(p) for p in body.get("pairs") or [])
        return ProbeDone(node, pairs, _short(body.get("device")) or MESH_INTERFACE)
    if kind is Kind.NET_PATH:
        at = {mesh_address(n, entry.mesh): n for n in range(len(entry.gang.members))}
        lost = body.get("lost")
        nodes = [at[a] for a in lost if a in at] if isinstance(lost, list) else []
        return NetPath(node, tuple(nodes))
    if kind is Kind.HUNG:
        first, last = (int(r) for r in body.get("ranks") or (0, 0))
        return MemberHung(node, bool(body.get("hung")), (first, last), int(body["silent_s"]))
    if kind is Kind.RENDEZVOUS_READY:
        return PortPublished(node, str(body["addr"]), int(body["port"]))
    if kind is Kind.MASTER_CHECKED:
        error = body.get("error")
        return MasterChecked(
            node,
            str(error)[:500] if error else None,
            _short(body.get("torch")),
            _short(body.get("nccl")),
        )
    if kind is Kind.MEMBER_STARTED:
        return MemberStarted(node)
    if kind is Kind.MEMBER_EXITED:
        return _exited(node, body)
    if kind is Kind.ARTIFACTS_DONE:
        errors = tuple(str(e) for e in body.get("errors") or [])
        return OutputsStored(node, ok=not errors, errors=errors)
    return None


def net_ready(entry: RunEntry, node: int, body: dict[str, Any]) -> NetReady:
    """NET_READY: the member's endpoint is where the reflector saw it (its NAT's public
    address and mapped port), or else its advertise address and the device's port."""
    if body.get("error"):
        at = {mesh_address(n, entry.mesh): n for n in range(len(entry.gang.members))}
        silent = body.get("silent")
        nodes = [at[a] for a in silent if a in at] if isinstance(silent, list) else []
        return NetReady(
            node,
            error=str(body["error"])[:500],
            silent=tuple(nodes),
            shim_not_loaded=bool(body.get("shim_not_loaded")),
        )
    key, port = str(body.get("public_key") or ""), int(body.get("port") or 0)
    if entry.gang.path is PathClass.RELAYED:  # a key, and the relays for an endpoint
        if not _is_wg_key(key):
            return NetReady(node, error=f"a malformed NET_READY (key {key[:8]!r})")
        return NetReady(node, key, "")
    host = entry.inventories[node].advertise_address or ""
    public = body.get("public")
    if isinstance(public, dict):
        seen = _address_port(public.get("addr"), public.get("port"))
        if seen is None:
            return NetReady(node, error=f"a malformed public endpoint {public!r}")
        host, port = seen
    if not _is_wg_key(key) or not 0 < port < 65536 or not host:
        return NetReady(node, error=f"a malformed NET_READY (key {key[:8]!r}, port {port})")
    endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    # The MTU it took: at most what this epoch offered, at least 1280 (an older agent
    # says none; anything else is not believed: it decides whether a stalled pair is
    # tried again with smaller packets or kept apart, so it must not outlast the offer).
    mtu = body.get("mtu")
    took = None
    if isinstance(mtu, int) and not isinstance(mtu, bool):
        took = mtu if MESH_MTU <= mtu <= (entry.offered_mtu or MESH_MTU_REGION) else None
    return NetReady(node, key, endpoint, mtu=took)


def _exited(node: int, body: dict[str, Any]) -> MemberExited:
    def number(key: str) -> int | None:
        value = body.get(key)
        return int(value) if value is not None else None

    return MemberExited(
        node=node,
        exit_code=int(body.get("exit_code", 1)),
        signal=str(body["signal"]) if body.get("signal") else None,
        failed_rank=number("failed_rank"),
        failed_exit=number("failed_exit"),
        tail=tuple(str(line) for line in body.get("tail") or []),
    )


def member_report(raw: Any) -> MemberReport:
    """One member an agent reports in its INVENTORY (after a restart or a redial)."""
    if not isinstance(raw, dict):
        raise ValueError(f"a reported member is a JSON object, not {type(raw).__name__}")
    code = raw.get("exit_code")
    seq = raw.get("last_log_seq")
    return MemberReport(
        job=str(raw["job"]),
        epoch=int(raw["epoch"]),
        node=int(raw["node_rank"]),
        exit_code=int(code) if code is not None else None,
        signal=str(raw["signal"]) if raw.get("signal") else None,
        last_log_seq=int(seq) if seq is not None else None,
    )


def _is_wg_key(key: str) -> bool:
    """A WireGuard public key: 32 bytes, base64."""
    try:
        return len(base64.b64decode(key, validate=True)) == 32
    except ValueError:
        return False


def _address_port(addr: object, port: object) -> tuple[str, int] | None:
    try:
        host, number = str(ipaddress.ip_address(str(addr))), int(str(port))
    except ValueError:
        return None
    return (host, number) if 0 < number < 65536 else None


def _probe_pair(raw: Any) -> ProbePair:
    if not isinstance(raw, dict):
        raise ValueError(f"a probe pair is a JSON object, not {type(raw).__name__}")

    def number(key: str) -> float | None:
        value = raw.get(key)
        return float(value) if isinstance(value, int | float) else None

    error = raw.get("error")
    return ProbePair(
        node=int(raw["node"]),
        connects=int(raw.get("connects") or 0),
        rtt_ms=number("rtt_ms"),
        gbps=number("gbps"),
        error=str(error)[:500] if error else None,
        via=_short(raw.get("via")),
        endpoint=_short(raw.get("endpoint")),
    )


def _short(value: object) -> str | None:
    """A short printable string from an agent (an interface, an endpoint), or None."""
    if not isinstance(value, str) or not value or len(value) > 64 or not value.isprintable():
        return None
    return value
