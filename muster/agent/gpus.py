"""The GPUs of this machine, as the vendor's own tool lists them: nvidia-smi (NVIDIA), else
rocm-smi (AMD). Both list every GPU of the machine whatever CUDA_VISIBLE_DEVICES says, so
indices are the machine's, as ``--devices`` names them.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field

from muster.errors import InfrastructureError
from muster.spec.worker import GpuVendor

SMI_TIMEOUT_S = 20
_AMD_NAME = re.compile(r"^GPU\[(\d+)\]\s*:\s*Card Series:\s*(.+?)\s*$", re.M | re.I)
_AMD_VRAM = re.compile(r"^GPU\[(\d+)\]\s*:\s*VRAM Total Memory \(B\):\s*(\d+)\s*$", re.M | re.I)


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory_mb: int


@dataclass(frozen=True)
class GpuList:
    vendor: GpuVendor | None = None  # None: no vendor tool on this machine
    tool: str = "nvidia-smi"
    gpus: list[Gpu] = field(default_factory=list)

    @property
    def indices(self) -> list[int]:
        return sorted(g.index for g in self.gpus)


def _run(argv: list[str]) -> str:
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=SMI_TIMEOUT_S, check=True
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise InfrastructureError(f"{argv[0]} failed: {exc}") from exc
    return done.stdout


def nvidia(smi: str) -> list[Gpu]:
    out = _run([smi, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"])
    found = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3 and parts[0].isdigit():
            memory = int(float(parts[2])) if parts[2].replace(".", "", 1).isdigit() else 0
            found.append(Gpu(int(parts[0]), parts[1], memory))
    return found


def amd(smi: str) -> list[Gpu]:
    out = _run([smi, "--showproductname", "--showmeminfo", "vram"])
    vram = {int(i): int(b) // (1024 * 1024) for i, b in _AMD_VRAM.findall(out)}
    return [Gpu(int(i), name, vram.get(int(i), 0)) for i, name in _AMD_NAME.findall(out)]


def list_gpus() -> GpuList:
    """This machine's GPUs; InfrastructureError when the vendor's tool is there but fails
    (a driver that is gone is not "no GPUs")."""
    smi, rocm = shutil.which("nvidia-smi"), shutil.which("rocm-smi")
    failed: InfrastructureError | None = None
    if smi is not None:
        try:
            return GpuList("nvidia", "nvidia-smi", nvidia(smi))
        except InfrastructureError as exc:
            failed = exc  # (an AMD box with a stray nvidia-smi: try rocm-smi)
    if rocm is not None:
        return GpuList("amd", "rocm-smi", amd(rocm))
    if failed is not None:
        raise failed
    return GpuList()
