"""ElChe's checkpoints: what a stopping cohort leaves behind, and how a rank resumes from it.

Per rank and save prefix ``P`` (seed 002, view 7):
- ``P.rank<N>.pt``: the model, the optimizer, and ElChe's own state (window, epoch, where the
  epoch's samples stood, the schedule's timings, the batches this rank ran since the last
  round, the live ranks, the RNG);
- ``P.rank<N>.meta.json``: why and when it was written (``reason``), and where (window,
  epoch, mode, backend, world), so a person or a resume can tell a stall from a request;
- ``P.rank<N>.death.json``: written instead by a rank that dies of an exception out of its
  training loop (not by one killed with a signal: SIGKILL, or torchrun's SIGTERM, leave
  nothing): why, where, and the exception's last lines.

Files are written to a temporary name and renamed, so a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from muster.errors import UserError


def paths(prefix: str | Path, rank: int) -> tuple[Path, Path, Path]:
    base = str(prefix)
    return (
        Path(f"{base}.rank{rank}.pt"),
        Path(f"{base}.rank{rank}.meta.json"),
        Path(f"{base}.rank{rank}.death.json"),
    )


def _atomic(path: Path, write: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, path)


def save(prefix: str | Path, rank: int, state: dict[str, Any], meta: dict[str, Any]) -> Path:
    """Write this rank's checkpoint and its metadata; returns the checkpoint's path."""
    checkpoint, metadata, _ = paths(prefix, rank)
    _atomic(checkpoint, lambda tmp: torch.save(state, tmp))
    record = dict(meta, rank=rank, time=time.time(), checkpoint=str(checkpoint))
    _atomic(metadata, lambda tmp: tmp.write_text(json.dumps(record, indent=2) + "\n"))
    return checkpoint


def load(prefix: str | Path, rank: int) -> dict[str, Any]:
    checkpoint, _, _ = paths(prefix, rank)
    if not checkpoint.exists():
        raise UserError(
            f"no checkpoint for rank {rank} at {checkpoint}: resume with the prefix the run "
            "saved to (ElChe(save=...)), on the same number of ranks"
        )
    state: dict[str, Any] = torch.load(checkpoint, map_location="cpu", weights_only=True)
    return state


def read_meta(prefix: str | Path, rank: int) -> dict[str, Any]:
    _, metadata, _ = paths(prefix, rank)
    loaded: dict[str, Any] = json.loads(metadata.read_text())
    return loaded


def death(
    prefix: str | Path, rank: int, reason: str, where: dict[str, Any], error: BaseException | None
) -> Path | None:
    """The sidecar of a dying rank; never raises (the rank is dying for another reason)."""
    _, _, record = paths(prefix, rank)
    body = dict(where, rank=rank, reason=reason, time=time.time())
    if error is not None:
        body["exception"] = "".join(traceback.format_exception_only(error)).strip()
        body["traceback"] = traceback.format_exception(error)[-6:]
    with contextlib.suppress(OSError):
        _atomic(record, lambda tmp: tmp.write_text(json.dumps(body, indent=2) + "\n"))
        return record
    return None
