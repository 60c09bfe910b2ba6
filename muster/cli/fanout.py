"""Fan-out for ``muster up FILE JOB``: one walk-in per configured worker, started over SSH.

Each worker gets one ``ssh`` session (never a password prompt) that carries a reverse
forward to the controller (``-R 127.0.0.1:PORT:<controller>``) and runs ``muster join``
there, dialling the forward's end: agents dial back through it, so the controller may stay
on loopback. The join secret goes down the session's standard input, read by the remote
shell's ``read`` builtin: it is on no command line, here or there. A session's end is that
host's exit (the controller sees its link close).
"""

from __future__ import annotations

import random
import shlex
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from muster.errors import UserError
from muster.spec.cluster import ClusterFile, Worker

FORWARD_TRIES = 4  # a reverse port taken on the worker: try another
FORWARD_FAILED = "remote port forwarding failed"


def ssh_argv(worker: Worker) -> list[str]:
    """The OpenSSH client's argv for ``worker``: never a password prompt, and a forward that
    cannot be set up ends the session instead of running without it."""
    ssh = worker.ssh
    argv = ["ssh", "-o", "BatchMode=yes", "-o", "ExitOnForwardFailure=yes", "-p", str(ssh.port)]
    if ssh.identity_file:
        argv += ["-i", str(Path(ssh.identity_file).expanduser())]
    for option in ssh.options:
        argv += ["-o", option]
    target = ssh.target or worker.host
    argv += ["--", f"{ssh.user}@{target}" if ssh.user else target]  # never read as an option
    return argv


def remote_command(
    worker: Worker, job: str, port: int, scheme: str = "http", gpu_ram_share: float | None = None
) -> str:
    """What the worker's shell runs: the join secret from stdin into the environment, the
    host's env, then ``muster join`` through the reverse forward."""
    parts = ["IFS= read -r MUSTER_TOKEN", "export MUSTER_TOKEN"]
    parts += [f"export {key}={shlex.quote(value)}" for key, value in worker.env.items()]
    if worker.path:
        parts.insert(0, f"cd {shlex.quote(worker.path)}")
    join = [worker.python, "-m", "muster", "join", f"{scheme}://127.0.0.1:{port}"]
    join += ["--job", job, "--host", worker.host]
    if isinstance(worker.devices, list):
        join += ["--devices", ",".join(map(str, worker.devices))]
    elif worker.procs is not None:
        join += ["--procs", str(worker.procs)]
    # devices: all (or nothing said): the box offers one rank per GPU it has
    if worker.interface:
        join += ["--interface", worker.interface]
    if worker.work_dir:
        join += ["--work-dir", worker.work_dir]
    for flag, value in (
        ("--provider", worker.provider),
        ("--region", worker.region),
        ("--region-class", worker.region_class),
    ):
        if value:
            join += [flag, value]
    if worker.data_path:
        join += ["--data-path", worker.data_path]
    if gpu_ram_share is not None:  # the host entry's, else the cluster's default
        join += ["--gpu-ram-share", f"{gpu_ram_share:g}"]
    return " && ".join([*parts, "exec " + shlex.join(join)])


def probe_devices(worker: Worker, timeout: float = 30) -> int:
    """``devices: all``: count the worker's GPUs over SSH (nvidia-smi, else rocm-smi: one
    line per GPU either way), at dispatch."""
    listing = (
        "nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null"
        " || rocm-smi --showproductname 2>/dev/null | grep -i 'Card Series'"
    )
    argv = [*ssh_argv(worker), listing]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"workers[{worker.host}]: probing its GPUs over ssh failed: {exc}") from exc
    count = len([line for line in done.stdout.splitlines() if line.strip()])
    if done.returncode != 0 or count == 0:
        said = " ".join(done.stderr.split())[-300:] or "no GPU listed"
        raise UserError(
            f"workers[{worker.host}]: devices: all, but nvidia-smi or rocm-smi over ssh found "
            f"none ({said}); "
            "list its devices, or give procs for a CPU host"
        )
    return count


@dataclass
class Session:
    """One worker's ssh session: its process, and where its output goes."""

    worker: Worker
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0
    said: list[str] = field(default_factory=list)  # its warnings and errors, for the console

    @property
    def done(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None


def start_session(
    worker: Worker,
    job: str,
    controller: tuple[str, str, int],
    secret: str,
    log: Path,
    *,
    gpu_ram_share: float | None = None,
    ready_s: float = 3.0,
) -> Session:
    """Start ``worker``'s walk-in; a reverse port already taken there is tried again on
    another. Raises UserError when ssh cannot get through, with its words."""
    session = Session(worker, log)
    scheme, host, port = controller
    last = ""
    for _ in range(FORWARD_TRIES):
        session.port = random.randint(20000, 60000)
        forward = f"127.0.0.1:{session.port}:{host}:{port}"
        argv = [*ssh_argv(worker)[:-2], "-R", forward, *ssh_argv(worker)[-2:]]
        argv.append(remote_command(worker, job, session.port, scheme, gpu_ram_share))
        out = open(log, "ab")  # noqa: SIM115 - owned by the process
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out, stderr=out)
        out.close()
        assert proc.stdin is not None
        try:
            try:
                proc.stdin.write(secret.encode() + b"\n")
                proc.stdin.close()
            except OSError:
                pass  # it ended at once: its log says why
            deadline = time.monotonic() + ready_s
            while time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.1)
        except BaseException:  # Ctrl-C while it starts: it goes too
            proc.kill()
            raise
        if proc.poll() is None:
            session.proc = proc
            return session
        last = " ".join(log.read_text(errors="replace").split())[-300:]
        if FORWARD_FAILED not in last:
            break
    raise UserError(f"ssh to {worker.host} ended at once (exit {proc.returncode}): {last}")


def watch(
    sessions: list[Session],
    on_line: IO[str] | None = None,
    on_end: Callable[[Session], None] | None = None,
) -> threading.Thread:
    """A thread that says when each session ends (its host left), and calls ``on_end``."""

    def run() -> None:
        seen: set[str] = set()
        while len(seen) < len(sessions):
            for s in sessions:
                if s.done and s.worker.host not in seen:
                    seen.add(s.worker.host)
                    if on_line is not None:
                        assert s.proc is not None
                        code = s.proc.returncode
                        on_line.write(f"[{s.worker.host}] ssh session ended ({code})\n")
                    if on_end is not None:
                        on_end(s)
            time.sleep(0.5)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def stop_sessions(sessions: list[Session], wait: float = 30) -> None:
    """The walk-ins leave on their own once the job is over; whatever is still up after
    ``wait`` is ended."""
    deadline = time.monotonic() + wait
    for s in sessions:
        if s.proc is None:
            continue
        try:
            s.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            s.proc.terminate()
            try:
                s.proc.wait(10)
            except subprocess.TimeoutExpired:
                s.proc.kill()


def capacity(cluster: ClusterFile) -> tuple[int, dict[str, int]]:
    """Every worker's ranks (``devices: all`` probed over SSH now) and their sum."""
    ranks: dict[str, int] = {}
    for worker in cluster.workers:
        ranks[worker.host] = worker.ranks if worker.ranks is not None else probe_devices(worker)
    return sum(ranks.values()), ranks
