"""The relayed path's preloaded library, ``libmuster-netshim.so`` (netshim.c beside this).

A relayed gang's ranks start with the shim first in ``LD_PRELOAD``: a TCP connect() to one of
the gang's peer addresses (``MUSTER_NETSHIM_PEERS``) goes to the member's SOCKS5 endpoint on
loopback (``MUSTER_NETSHIM_SOCKS``), which carries it through the relays; every other
connection goes out directly. The shim is built when muster is installed (setup.py); where no
C compiler was found it is missing, and :func:`library` says how to get it.

:func:`self_test` is the probe's check that the job's own launcher loads it: a static or musl
program ignores ``LD_PRELOAD``, and its ranks would never reach their peers.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from muster.errors import InfrastructureError

LIBRARY_NAME = "libmuster-netshim.so"
SELF_TEST_S = 60.0
VERSION = "muster-netshim 1"

# What the launcher runs to prove it: the shim's own symbol, resolved in the process itself.
_CHECK = (
    "import ctypes; f = ctypes.CDLL(None).muster_netshim_version; "
    "f.restype = ctypes.c_char_p; print(f().decode())"
)


def library() -> str:
    """The shim's path; InfrastructureError, with the fix, when this install has none."""
    path = Path(__file__).resolve().parent.parent / LIBRARY_NAME
    if not path.is_file():
        raise InfrastructureError(
            f"{LIBRARY_NAME} was not built when muster was installed (no C compiler?): "
            "install gcc and the libc headers (Debian: apt-get install gcc libc6-dev) and "
            "reinstall muster; until then this agent cannot join a relayed gang"
        )
    return str(path)


def self_test(python: str, preload: str, timeout: float = SELF_TEST_S) -> str | None:
    """None when ``python`` (the job's launcher) loads the shim given as ``preload`` (the
    LD_PRELOAD the ranks get); else why not, for ShimNotLoaded."""
    try:
        done = subprocess.run(
            [python, "-c", _CHECK],
            env={"LD_PRELOAD": preload, "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the launcher {python} could not be run: {exc}"
    if done.returncode == 0 and done.stdout.strip() == VERSION:
        return None
    said = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
    return (
        f"the launcher {python} did not load {LIBRARY_NAME} ({said}): a static or musl "
        "program ignores LD_PRELOAD, so its ranks cannot reach their peers on the relayed "
        "path. Use a glibc-based image (Debian, Ubuntu, any CUDA image), or transport: direct"
    )
