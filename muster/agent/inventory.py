"""What this machine offers: GPUs, the jobs' Python with torch and torchrun, its address."""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

import platformdirs
import psutil

from muster.agent.gpus import list_gpus
from muster.errors import InfrastructureError, UserError
from muster.net.wireguard import device_unavailable, has_cap_net_admin
from muster.spec import MESH_INTERFACE, Gpus, NetworkCaps, WorkerInventory
from muster.spec.worker import UNDECLARED

log = logging.getLogger("muster.agent")

_PROBE = """
import importlib.util, json, platform
out = {"python": platform.python_version(), "torch": None, "torchrun": False, "backends": []}
try:
    import torch, torch.distributed as dist
    out["torch"] = torch.__version__.split("+")[0]
    out["torchrun"] = importlib.util.find_spec("torch.distributed.run") is not None
    if dist.is_available() and dist.is_gloo_available():
        out["backends"].append("gloo")
    if dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available():
        out["backends"].append("nccl")
except Exception:
    pass
print(json.dumps(out))
"""


# What the probe's answer depends on, read in the jobs' Python without importing torch (tens
# of ms where the probe takes seconds), so a wrapper script's environment counts too: the
# interpreter, every directory on its import path with its mtime (any install or removal in
# one moves it), torch's own files, the prefix's libraries (conda's CUDA and NCCL live there)
# and those on LD_LIBRARY_PATH, the GPU driver's version, and the variables that pick devices
# and libraries.
_FINGERPRINT = """
import glob, importlib.util, json, os, sys
def stat(path):
    try:
        st = os.stat(path)
        return [path, st.st_mtime_ns, st.st_size]
    except OSError:
        return [path, None, None]
def read(path):
    try:
        with open(path) as f:
            return f.read(4096)
    except OSError:
        return None
VARS = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONPATH", "PYTHONHOME")
libs = [sys.prefix + "/lib", sys.prefix + "/conda-meta"]
libs += [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
out = {"version": sys.version, "executable": os.path.realpath(sys.executable),
       "path": [stat(str(p)) for p in sys.path if p], "libs": [stat(d) for d in libs],
       "driver": [read("/proc/driver/nvidia/version"), read("/sys/module/amdgpu/version")],
       "env": {k: os.environ.get(k) for k in VARS}, "torch": None}
try:
    spec = importlib.util.find_spec("torch")
except Exception as exc:  # a broken torch: fingerprinted by what is wrong
    spec, out["torch"] = None, repr(exc)
if spec is not None and spec.origin:
    root = os.path.dirname(spec.origin)
    files = [spec.origin, os.path.join(root, "version.py")]
    files += sorted(glob.glob(os.path.join(root, "_C*.so")))
    files += sorted(glob.glob(os.path.join(root, "lib", "*.so*")))
    out["torch"] = [stat(f) for f in files]
print(json.dumps(out, default=str))
"""
PROBE_CACHE_TTL_S = 24 * 3600.0
_NO_PYTHON: dict[str, object] = {"python": "", "torch": None, "torchrun": False, "backends": []}


def _run_json(python: str, code: str, timeout: float) -> dict[str, object] | None:
    try:
        done = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=timeout, check=False
        )
        data = json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError, IndexError):
        return None
    return data if isinstance(data, dict) else None


def probe_cache_dir() -> Path:
    """Where probe answers are kept: the cache dir of the user the agent runs as
    (~/.cache/muster/python-probe on Linux, XDG_CACHE_HOME honoured)."""
    return Path(platformdirs.user_cache_dir("muster")) / "python-probe"


def probe_python(python: str, gpus: Gpus | None = None) -> dict[str, object]:
    """torch version, torchrun and backends as the jobs' Python sees them.

    Importing torch to ask takes seconds of CPU (2.4 s here), paid by every agent start. The
    answer is kept in the user's cache for a day, under a fingerprint of everything it
    depends on (see _FINGERPRINT; with the GPUs and the Python named, whose file is stat'ed
    too: a wrapper script edited asks again). An answer that lists GPUs but no NCCL (CUDA not
    working) is not kept: it may be mended."""
    fingerprint = _run_json(python, _FINGERPRINT, 60)
    path: Path | None = None
    if fingerprint is not None:
        named = shutil.which(python) or python
        try:
            st = os.stat(named)
            wrapper: list[object] = [named, st.st_mtime_ns, st.st_size]
        except OSError:
            wrapper = [named, None, None]
        key = {
            "python": wrapper,
            "fingerprint": fingerprint,
            "gpus": gpus.model_dump(mode="json") if gpus is not None else None,
        }
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        path = probe_cache_dir() / f"{digest}.json"
        cached = _read_cached(path)
        if cached is not None:
            return cached
    data = _run_json(python, _PROBE, 120)
    if data is None:
        return dict(_NO_PYTHON)
    backends = data.get("backends")
    backends = backends if isinstance(backends, list) else []
    cuda_broken = gpus is not None and gpus.count > 0 and "nccl" not in backends
    if path is not None and data.get("torch") and not cuda_broken:
        _write_cached(path, data)
    return data


def _owned_and_private(st: os.stat_result) -> bool:
    """Ours, and writable by no one else: an answer another user could plant would make
    this agent report a torch it does not have."""
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _read_cached(path: Path) -> dict[str, object] | None:
    try:
        st = path.stat()
        if not (_owned_and_private(st) and _owned_and_private(path.parent.stat())):
            return None
        if abs(time.time() - st.st_mtime) > PROBE_CACHE_TTL_S:  # (a clock set back too)
            return None
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("backends"), list):
        return None
    return data


def _write_cached(path: Path, data: dict[str, object]) -> None:
    """Atomically (agents starting together may write the same answer), after removing the
    answers past their day; a cache that cannot be written costs the next start its seconds."""
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        for old in path.parent.iterdir():
            with contextlib.suppress(OSError):
                if abs(time.time() - old.stat().st_mtime) > PROBE_CACHE_TTL_S:
                    old.unlink()
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".probe-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        log.debug("cannot keep the python probe's answer in %s: %s", path.parent, exc)
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def probe_gpus() -> Gpus:
    """The GPUs nvidia-smi or rocm-smi lists; none when neither is there (or it fails)."""
    try:
        found = list_gpus()
    except InfrastructureError:
        return Gpus()
    if not found.gpus:
        return Gpus()
    first = found.gpus[0]
    return Gpus(
        count=len(found.gpus), vendor=found.vendor, model=first.name, memory_mb=first.memory_mb
    )


def advertise_address_for(controller_url: str) -> str:
    """The local address that routes to the controller (loopback stays loopback)."""
    host = urlparse(controller_url).hostname or "127.0.0.1"
    try:
        if ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
            return "127.0.0.1"
    except (OSError, ValueError):
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # no packet is sent: this only picks the route
        return str(s.getsockname()[0])


def interface_of(address: str) -> str | None:
    """The local interface that holds ``address``; None when none does (a NAT's or an
    elastic address): the ranks then bind where torch decides, unless --interface says."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == address for a in addrs):
            return name
    return "lo" if ipaddress.ip_address(address).is_loopback else None


def check_interface(name: str) -> str:
    """``muster agent --interface NAME``: it must exist on this machine."""
    present = sorted(psutil.net_if_addrs())
    if name not in present:
        raise UserError(
            f"--interface {name}: no such interface here; pick one of {', '.join(present)}"
        )
    return name


def bind_problem(interface: str | None, address: str) -> tuple[str | None, str | None]:
    """Before torchrun starts: (problem, warning). The interface the ranks will bind must
    exist (else every rank hangs at the rendezvous); that it does not hold the address
    this node advertises is only worth a warning (a NAT's or elastic address, or a host that
    advertises one network and binds another, is the operator's choice)."""
    if not interface:
        return None, None
    present = psutil.net_if_addrs()
    if interface not in present:
        return (
            f"the interface {interface} the ranks would bind (NCCL_SOCKET_IFNAME, "
            f"GLOO_SOCKET_IFNAME) is not on this host now; it has {', '.join(sorted(present))}. "
            "Fix: restart the agent with --interface naming one of them",
            None,
        )
    held = [a.address.split("%")[0] for a in present[interface]]
    try:
        wanted = str(ipaddress.ip_address(address.split("%")[0]))
    except ValueError:
        return None, None  # a name: resolved by the peers, not checked here
    if wanted not in held:
        return None, (
            f"the interface {interface} does not hold {address}, the address this node "
            f"advertises to the gang (it holds {', '.join(held) or 'none'}): the other "
            "nodes must reach this one there"
        )
    return None, None


def network_caps(
    address: str,
    private_network: str | None,
    interface: str | None = None,
    device: str = MESH_INTERFACE,
) -> NetworkCaps:
    """Hosts on one loopback, or on one declared network (``--private-network``), share a
    private path; nothing is guessed from addresses (two hosts in one /24 may still sit
    behind different firewalls): the probe proves the path before any rank starts."""
    iface = interface or interface_of(address)
    net_id: str | None
    if ipaddress.ip_address(address).is_loopback:
        net_id = f"loopback:{socket.gethostname()}"
    else:
        net_id = private_network or None
    return NetworkCaps(
        private_network_id=net_id,
        private_address=address,
        private_interface=iface,
        primary_interface=iface,
        # The direct path: this agent can make a WireGuard device (CAP_NET_ADMIN, a TUN
        # device or kernel WireGuard, and wg); a container without CAP_NET_ADMIN cannot.
        can_create_device=device_unavailable() is None,
        container_only=not has_cap_net_admin(),
        device=device,
    )


def collect(
    worker_id: str,
    python: str,
    address: str,
    private_network: str | None = None,
    labels: dict[str, str] | None = None,
    interface: str | None = None,
    device: str = MESH_INTERFACE,
    location: tuple[str, str, str] = (UNDECLARED, UNDECLARED, UNDECLARED),
) -> WorkerInventory:
    gpus = probe_gpus()
    py = probe_python(python, gpus)
    backends = [str(b) for b in py.get("backends", [])]  # type: ignore[attr-defined]
    return WorkerInventory(
        id=worker_id,
        hostname=socket.gethostname(),
        advertise_address=address,
        python_version=str(py.get("python") or ""),
        torch_version=str(py["torch"]) if py.get("torch") else None,
        torchrun=bool(py.get("torchrun")),
        backends=backends,
        gpus=gpus,
        provider=location[0],
        region=location[1],
        region_class=location[2],
        network=network_caps(address, private_network, interface, device),
        labels=labels or {},
    )
