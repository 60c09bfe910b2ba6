"""The root-cause texts users read when a member fails or its outputs do not arrive."""

from __future__ import annotations

from muster.gang.catalogue import classify
from muster.gang.events import MemberExited


def root_cause(
    node: int, worker: str, exited: MemberExited, *, sockets_expected: bool = False
) -> str:
    """The job's root cause for a member that exited non-zero (the text users see);
    ``sockets_expected``: the gang's path runs NCCL over TCP sockets on purpose."""
    rank = exited.failed_rank
    code = exited.failed_exit if exited.failed_exit is not None else exited.exit_code
    who = f"global rank {rank}" if rank is not None else "torchrun"
    how = f"was killed by {exited.signal}" if exited.signal else f"exited with code {code}"
    cause = f"node{node} (worker {worker}): {who} {how}"
    tail = [str(line) for line in exited.tail][-20:]
    named = classify(tail, exited.signal, sockets_expected=sockets_expected)
    if named is not None:  # a failure the catalogue knows: its name and the fix
        cause += "\n" + named.text()
    if tail:
        label = f"rank {rank}" if rank is not None else f"node{node}"
        cause += f"\nlast lines of {label}:\n" + "\n".join(f"  {line}" for line in tail)
    return cause


def upload_cause(node: int, worker: str, errors: tuple[str, ...]) -> str:
    """The job's root cause for outputs that failed to upload (the text users see)."""
    shown = "\n".join(f"  {e}" for e in errors[:20]) or "  (no detail)"
    more = f"\n  ... and {len(errors) - 20} more" if len(errors) > 20 else ""
    return (
        f"node{node} (worker {worker}) could not upload {len(errors)} output file(s); "
        f"they stay in the agent's work dir:\n{shown}{more}"
    )
