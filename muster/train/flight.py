"""A rank's flight recorder, readable while the rank runs (``muster stacks``).

torch's flight recorder keeps the last N collectives of every process group of a rank (the
buffer is ``TORCH_FR_BUFFER_SIZE``, or ``TORCH_NCCL_TRACE_BUFFER_SIZE`` for NCCL; 0, the
default, records nothing). Only the rank's own process can read it, so a rank that wants
``muster stacks`` to say which collective it is parked in serves it on a Unix socket: torch's
own worker server (``/handler/fr_trace_json``), in the directory muster names in
``MUSTER_DIAG_DIR``, as ``rank<RANK>.sock``. muster sets that variable only when the job's
environment turns the flight recorder on, in a directory only the agent's user may enter.

:func:`serve` does it; :class:`muster.train.ElChe` calls it for its users, and any script
may call it once, before or after ``init_process_group``::

    from muster.train.flight import serve
    serve()  # does nothing unless muster launched this rank with the flight recorder on

It works the same on gloo and NCCL (a CPU job's gloo collectives are recorded too).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from typing import Any

ENV = "MUSTER_DIAG_DIR"
_SUN_PATH_MAX = 107  # a Unix socket's path, without its NUL
_server: Any = None


def socket_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.sock")


def serve() -> bool:
    """Serve this rank's flight recorder where muster reads it; True when it is served.
    Idempotent; never raises: a rank trains the same whether or not it could."""
    global _server
    if _server is not None:
        return True
    directory, rank = os.environ.get(ENV), os.environ.get("RANK", "")
    if not directory or not rank.isdigit():
        return False
    path = socket_path(directory, int(rank))
    if len(path.encode()) > _SUN_PATH_MAX:
        print(f"muster: flight recorder not served: {path} is too long", file=sys.stderr)
        return False
    try:
        from torch._C._distributed_c10d import _WorkerServer
    except ImportError:  # a torch without the worker server (or without distributed)
        return False
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # this rank's own, left by an earlier restart of it
    try:
        _server = _WorkerServer(path)
    except Exception as exc:  # the rank goes on without it
        print(f"muster: flight recorder not served: {exc}", file=sys.stderr)
        return False
    atexit.register(_shutdown)
    return True


def _shutdown() -> None:
    global _server
    server, _server = _server, None
    if server is not None:
        with contextlib.suppress(Exception):
            server.shutdown()
