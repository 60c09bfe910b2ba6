"""Ranks' stacks folded for reading (``muster stacks``, the Hung event): ranks in the same
place print once, the fewest first. Pure text."""

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


def folded(stacks: list[dict[str, Any]]) -> list[tuple[list[int], str]]:
    """(ranks, stack) per distinct stack, the fewest ranks first (ties: lowest rank)."""
    groups: dict[str, list[int]] = {}
    for item in stacks:
        groups.setdefault(normalized(str(item["text"])), []).append(int(item["rank"]))
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
