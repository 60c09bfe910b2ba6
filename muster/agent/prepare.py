"""What a walk-in box checks before each dial (seed 003's "prepare"): the GPUs it offers are
there, its stage directory takes writes, and its data signature is of the data as it is now.
A box that fails a check would be admitted and then fail its ranks once the world formed,
holding every other box of the world with it; so it does not dial until they pass
(``--persist``: it waits and checks again).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from muster.agent.datasig import data_signature
from muster.agent.gpus import GpuList, list_gpus
from muster.errors import InfrastructureError
from muster.spec import WorkerInventory

STAGE_FREE_MIN = 64 * 1024 * 1024  # a bundle, the ranks' logs, a rendezvous file


class NotReady(InfrastructureError):
    """This box cannot walk in right now; the message names the check and the fix."""


def gpu_gate(offered: Sequence[int], present: GpuList) -> str:
    """Why the GPUs named by ``--devices`` cannot be offered ("" when they can)."""
    wanted = ",".join(map(str, offered))
    if not present.gpus:
        return (
            f"--devices {wanted}: this box has no GPU that nvidia-smi or rocm-smi lists; "
            "offer CPU ranks with --procs N instead"
        )
    missing = [d for d in offered if d not in present.indices]
    if missing:
        return (
            f"--devices {wanted}: GPU {','.join(map(str, missing))} is not on this box "
            f"({present.tool} lists {','.join(map(str, present.indices))}); list only those"
        )
    return ""


def stage_dir_problem(path: Path, free_min: int = STAGE_FREE_MIN) -> str:
    """Why ``path`` cannot hold a job's stage (its bundle, logs and outputs): "" when it can."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".muster-write-check-") as fh:
            fh.write(b"muster")
            fh.flush()
            os.fsync(fh.fileno())
        free = shutil.disk_usage(path).free
    except OSError as exc:
        return (
            f"the stage directory {path} takes no writes ({exc.strerror or exc}); "
            "free it, fix its permissions or pass --work-dir"
        )
    if free < free_min:
        return (
            f"the stage directory {path} has {free // (1024 * 1024)} MiB free (under "
            f"{free_min // (1024 * 1024)} MiB); free space there or pass --work-dir"
        )
    return ""


@dataclass
class Preparation:
    """The checks of one walk-in box, run before every dial."""

    stage_dir: Path
    devices: list[int] | None = None  # --devices, when given
    data_path: Path | None = None  # --data-path, when given
    data_sig: str | None = None  # its signature at the last check

    def check(self) -> None:
        """Raise NotReady naming the first check that fails."""
        if self.devices is not None:
            try:
                present = list_gpus()
            except InfrastructureError as exc:
                raise NotReady(f"the GPU gate could not list this box's GPUs: {exc}") from exc
            problem = gpu_gate(self.devices, present)
            if problem:
                raise NotReady(problem)
        problem = stage_dir_problem(self.stage_dir)
        if problem:
            raise NotReady(problem)
        if self.data_path is not None:
            if not self.data_path.is_dir():
                raise NotReady(f"--data-path {self.data_path} is not a directory this box can read")
            try:
                self.data_sig = data_signature(self.data_path, self.stage_dir / ".data-sig")
            except OSError as exc:
                raise NotReady(f"--data-path {self.data_path}: cannot read it ({exc})") from exc

    def stamp(self, inventory: WorkerInventory) -> WorkerInventory:
        """The walk-in's offer with the data signature of the last check."""
        join = inventory.join
        if join is None or self.data_path is None or join.data_sig == self.data_sig:
            return inventory
        return inventory.model_copy(
            update={"join": join.model_copy(update={"data_sig": self.data_sig})}
        )
