"""Admission at the door (seed 003): whether a walk-in may join the cohort already on the
roster. Pure. The first admitted walk-in sets the cohort's facts; each later one must agree,
and a refusal names both sides and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Vendor = Literal["nvidia", "amd"] | None  # None: a CPU box


@dataclass(frozen=True)
class Hello:
    """What a walk-in says of itself when it dials the window."""

    host: str
    vendor: Vendor
    torch: str  # torch.__version__ on the box
    run: str  # the run id it fetched (a publish mints a fresh one)
    model_sig: str  # hash of the source bundle it holds
    data_sig: str | None = None  # hash of its data manifest, when the job declares data


_VENDOR_NAMES = {"nvidia": "NVIDIA (CUDA)", "amd": "AMD (ROCm)", None: "CPU only"}


def refusal(cohort: Hello | None, hello: Hello, backend: str) -> str:
    """Why ``hello`` may not join a roster whose first member said ``cohort`` ("" when it
    may). ``backend`` is the job's collective backend (nccl refuses mixed vendors)."""
    if backend == "nccl" and hello.vendor is None:
        return (
            f"{hello.host} offers no GPU but the job runs nccl; join it to a gloo job, or "
            "run muster join on a GPU box"
        )
    if cohort is None:
        return ""
    if hello.run != cohort.run:
        return (
            f"{hello.host} holds run {hello.run}, the window is forming run {cohort.run} "
            f"(as {cohort.host} holds it): the run was published again; dial again to fetch "
            "the current run (muster join --persist does)"
        )
    if backend == "nccl" and hello.vendor != cohort.vendor:
        mine, theirs = _VENDOR_NAMES[hello.vendor], _VENDOR_NAMES[cohort.vendor]
        return (
            f"{hello.host}'s GPUs are {mine} but the cohort's are {theirs} (as {cohort.host}'s): "
            "NCCL cannot join vendors in one world (it would hang at formation); join this box "
            f"to a cohort of {mine} GPUs, or run the job on a CPU backend (gloo), which mixes "
            "vendors"
        )
    if hello.torch != cohort.torch:
        return (
            f"{hello.host} runs torch {hello.torch} but the cohort runs torch {cohort.torch} "
            f"(as {cohort.host}): install torch=={cohort.torch} on {hello.host}"
        )
    if hello.model_sig != cohort.model_sig:
        return (
            f"{hello.host}'s model signature {hello.model_sig[:12]} differs from the cohort's "
            f"{cohort.model_sig[:12]} (as {cohort.host}'s): its source tree is not the run's; "
            "fetch the published source again"
        )
    if hello.data_sig != cohort.data_sig:  # either side holding data makes it a condition
        got = hello.data_sig[:12] if hello.data_sig else "none"
        theirs = cohort.data_sig[:12] if cohort.data_sig else "none"
        return (
            f"{hello.host}'s dataset signature {got} differs from the cohort's {theirs} (as "
            f"{cohort.host}'s): its data_path does not hold the same files; sync the data, or "
            "give every box its --data-path (or none)"
        )
    return ""
