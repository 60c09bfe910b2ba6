"""Ranks' stacks folded for reading (``muster stacks``, the Hung event): ranks in the same
place print once, the fewest first; and the collective a rank is parked in, read from torch's
flight recorder. Pure: text and JSON in, text and small dicts out."""

from __future__ import annotations

import re
from typing import Any

_HEADER = re.compile(r"^(Process \d+:|Python v)")
_THREAD = re.compile(r"^(Thread) (0x[0-9A-Fa-f]+|\d+)")


def normalized(text: str) -> str:
    """A rank's stacks without what differs between identical ranks (pids, thread ids)."""
    lines = [line for line in text.splitlines() if not _HEADER.match(line)]
    return "\n".join(_THREAD.sub(r"\1", line) for line in lines).strip()


def ranks_label(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> 'rank0-2,5'."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return "rank" + ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)


def parked(dump: dict[str, Any], now_ns: int) -> dict[str, Any]:
    """What a rank's flight recorder (torch's ``fr_trace_json``) says of where it waits: the
    oldest collective not yet retired (the one the rank is blocked on; on gloo every entry
    stays "scheduled", so "retired" is what tells), else the last one it finished.

    ``{"seq", "op", "group", "sizes", "dtypes", "state", "age_s"}`` for a rank in a
    collective; ``{"seq": None, "last_seq", "last_op", "group"}`` for one between them;
    ``{"seq": None}`` for one that ran none yet.
    """
    entries = [e for e in dump.get("entries") or [] if isinstance(e, dict)]
    open_ = [e for e in entries if not e.get("retired", True)]
    if open_:
        e = min(open_, key=lambda e: int(e.get("time_created_ns") or 0))
        created = int(e.get("time_created_ns") or 0)
        return {
            "seq": _seq(e),
            "op": _op(e),
            "group": _group(e),
            "sizes": [list(s) for s in (e.get("input_sizes") or [])][:4],
            "dtypes": [str(d) for d in (e.get("input_dtypes") or [])][:4],
            "state": str(e.get("state") or "?"),
            "age_s": round(max(0.0, (now_ns - created) / 1e9), 1) if created else None,
        }
    if not entries:
        return {"seq": None}
    last = max(entries, key=lambda e: int(e.get("time_created_ns") or 0))
    return {"seq": None, "last_seq": _seq(last), "last_op": _op(last), "group": _group(last)}


def _seq(entry: dict[str, Any]) -> int:
    key = "p2p_seq_id" if entry.get("is_p2p") else "collective_seq_id"
    return int(entry.get(key) or 0)


def _op(entry: dict[str, Any]) -> str:
    """'nccl:all_reduce' -> 'all_reduce'."""
    return str(entry.get("profiling_name") or "?").rsplit(":", 1)[-1]


def _group(entry: dict[str, Any]) -> str:
    group = entry.get("process_group")
    if isinstance(group, list) and group:
        return str(group[-1] or group[0])
    return "?"


def parked_line(where: dict[str, Any] | None) -> str:
    """One line for a rank's collective; "" when there is no flight recorder."""
    if not where:
        return ""
    if where.get("seq") is None:
        if where.get("last_seq") is None:
            return "collective: none yet (flight recorder)"
        return (
            f"collective: none in flight; last {where.get('last_op')} "
            f"#{where.get('last_seq')} on {where.get('group')} (flight recorder)"
        )
    dtypes, sizes = where.get("dtypes") or [], where.get("sizes") or []
    shape = ", ".join(f"{d}{list(s)}" for d, s in zip(dtypes, sizes, strict=False))
    return (
        f"collective: in {where.get('op')} #{where.get('seq')} on {where.get('group')}"
        + (f" ({shape})" if shape else "")
        + f", {where.get('state')} (flight recorder)"
    )


def folded(stacks: list[dict[str, Any]]) -> list[tuple[list[int], str]]:
    """(ranks, stack) per distinct stack, the fewest ranks first (ties: lowest rank). A rank's
    collective (from the flight recorder, where the job runs it) heads its stack and is part
    of what must match: ranks in different collectives are in different places."""
    groups: dict[str, list[int]] = {}
    for item in stacks:
        head = parked_line(item.get("collective"))
        text = normalized(str(item["text"]))
        groups.setdefault(f"{head}\n{text}" if head else text, []).append(int(item["rank"]))
    return sorted(
        ((sorted(r), text) for text, r in groups.items()), key=lambda g: (len(g[0]), g[0])
    )


def folded_text(stacks: list[dict[str, Any]]) -> str:
    """The folded stacks as one text: a ``[rank3]`` header per group, its frames indented."""
    blocks = []
    for ranks, text in folded(stacks):
        body = "\n".join(f"  {line}" for line in text.splitlines())
        blocks.append(f"[{ranks_label(ranks)}]\n{body}")
    return "\n".join(blocks)
