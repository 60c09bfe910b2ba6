"""One member of a gang on this machine: bundle, torchrun, capture, stop, outputs (seed 001)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import io
import logging
import os
import shutil
import signal
import sys
import tarfile
import tempfile
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path, PurePosixPath
from typing import Any

import httpx
import psutil

from muster.agent.capture import (
    Line,
    RankTailer,
    failed_pids,
    line_fields,
    list_outputs,
    root_cause,
)
from muster.agent.hang import (
    CHECK_EVERY_S,
    HangWatch,
    KernelLog,
    kernel_oom_lines,
    tree_cpu_seconds,
)
from muster.agent.inventory import bind_problem
from muster.agent.reaper import terminate
from muster.errors import InfrastructureError
from muster.net import cgroup
from muster.net.cgroup import RankGroup
from muster.plan import GangAddressing, Shim, launch_env, rank_plan, torchrun_argv
from muster.plan.env import DIAG_DIR_ENV, flight_recorder_on
from muster.spec import JobSpec, PathClass
from muster.wire import Kind

log = logging.getLogger("muster.agent")

# Sends a frame on the agent's link; False when there was no link to send it on.
Send = Callable[[Kind, dict[str, Any]], Awaitable[bool]]
# How torchrun is started: asyncio.create_subprocess_exec (a seam for the tests).
Spawn = Callable[..., Awaitable[asyncio.subprocess.Process]]
POLL_S = 0.05  # how often the rank files are read while they grow
QUIET_POLL_S = 0.25  # and once they have been quiet for QUIET_AFTER_S
QUIET_AFTER_S = 1.0
REAPER_DELAY_S = 5.0
UPLOAD_PATIENCE_S = 600.0  # how long an upload waits for an unreachable controller
LOGS_DRAIN_S = 30.0  # how long an exit report waits for the member's lines to be stored


class MemberRun:
    """Runs node ``node_rank`` of a job's gang until it exits or is stopped."""

    def __init__(
        self,
        assignment: dict[str, Any],
        *,
        work_dir: Path,
        python: str,
        http: httpx.AsyncClient,
        send: Send,
        emit: Callable[[list[Line]], None],
        grace: float,
        alive_file: Path | None = None,
        watchdog_timeout: float = 30.0,
        spawn: Spawn = asyncio.create_subprocess_exec,
        link_up: asyncio.Event | None = None,
        upload_patience: float = UPLOAD_PATIENCE_S,
        may_read: Callable[[], bool] = lambda: True,
        host_env: dict[str, str] | None = None,
        release_port: Callable[[], None] = lambda: None,
        logs_held: Callable[[], int] = lambda: 0,
        shim: Shim | None = None,
    ) -> None:
        self.job = str(assignment["job"])
        # Node 0's agent holds the rendezvous port until torchrun is about to take it.
        self.release_port = release_port
        self.shim = shim  # the relayed path's preload and SOCKS5 endpoint
        # The member's lines the controller has not stored yet: its exit waits for them.
        self.logs_held = logs_held
        # What only this box knows (a walk-in's data path, its GPU's share of RAM): it rides
        # the assignment into the ranks' environment, over anything the job said.
        self.host_env = dict(host_env or {})
        self.epoch = int(assignment["epoch"])
        self.node = int(assignment["node_rank"])
        self.spec = JobSpec.model_validate(assignment["spec"], strict=False)
        self.addressing = GangAddressing(
            PathClass(assignment["path"]),
            tuple(assignment["addresses"]),
            tuple(assignment["interfaces"]),
            int(assignment["master_port"]),
        )
        self.bundle: str | None = assignment.get("bundle")
        self.dir = work_dir / self.job / f"node{self.node}"
        self.python = python
        self.http = http
        self.send = send
        self.emit = emit
        self.grace = grace
        self.proc: asyncio.subprocess.Process | None = None
        self.stopping: str | None = None
        self.launcher_lines: deque[str] = deque(maxlen=400)
        self._launcher_seq = 0
        self.task: asyncio.Task[None] | None = None
        self._stop_task: asyncio.Task[None] | None = None
        self.watchdog_timeout = watchdog_timeout
        self.alive_file = alive_file
        self.spawn = spawn
        if link_up is None:
            link_up = asyncio.Event()
            link_up.set()
        self.link_up = link_up
        self.upload_patience = upload_patience
        self.may_read = may_read
        self.exit_code: int | None = None  # set once torchrun (or the set-up) has ended
        self.signal: str | None = None
        # Reports (MEMBER_EXITED, ARTIFACTS_DONE) the controller has not acked yet: sent
        # again on every new link until it does (REPORT_ACK), so none is lost in flight.
        self.unacked: dict[Kind, dict[str, Any]] = {}
        self.finished = False  # run() has returned: no process of the member is left
        self.hung_report: dict[str, Any] | None = None  # the HUNG it said, while it holds
        self.kernel_log: KernelLog | None = None  # opened at torchrun's start
        self.diag_dir: str | None = None  # where the ranks serve their flight recorder
        self._tasks: set[asyncio.Future[object]] = set()
        # The cgroup torchrun starts in (set by the agent for a gang across hosts): the
        # firewall tells the ranks' sockets by it (muster.net.cgroup).
        self.group: RankGroup | None = None
        self.guarded = False  # the gang's rules guard this member: its ranks lose net caps

    def ids(self) -> dict[str, Any]:
        return {"job": self.job, "epoch": self.epoch, "node_rank": self.node}

    async def run(self) -> None:
        run_dir = self.dir / "src"
        out_dir = run_dir / self.spec.output_dir
        capture_dir = self.dir / "logs"
        try:
            if self.dir.exists():
                shutil.rmtree(self.dir)
            run_dir.mkdir(parents=True)
            if self.bundle:
                await self._fetch_bundle(run_dir)
            out_dir.mkdir(parents=True, exist_ok=True)
        except (OSError, InfrastructureError, httpx.HTTPError, tarfile.TarError) as exc:
            self._launcher_line("stderr", f"muster: could not prepare the run directory: {exc}")
            await self._exited({"exit_code": 127, "tail": list(self.launcher_lines)})
            return
        if self.stopping:
            await self._exited({"exit_code": 143, "signal": "SIGTERM"})
            return
        addressing = self.addressing
        # The ranks will bind this interface and the others dial this address: a wrong
        # pair would hang every rank at the rendezvous, so the member fails now, saying so.
        problem, warning = await asyncio.to_thread(
            bind_problem, addressing.interfaces[self.node], addressing.addresses[self.node]
        )
        if warning:
            self._launcher_line("stderr", f"muster: warning: {warning}")
        if problem:
            self._launcher_line("stderr", f"muster: {problem}")
            await self._exited({"exit_code": 127, "tail": list(self.launcher_lines)})
            return
        argv = torchrun_argv(
            self.spec,
            self.node,
            addressing.master_addr,
            addressing.master_port,
            python=self.python,
            capture_dir=str(capture_dir),
        )
        env = launch_env(
            self.spec,
            self.node,
            addressing,
            node_env=os.environ,
            shim=self.shim,
            output_dir=str(out_dir),
        )
        env.update(self.host_env)
        if flight_recorder_on(env):
            # The ranks serve their flight recorder here (muster.train.flight): a directory
            # only this user may enter, with a path short enough for a Unix socket.
            self.diag_dir = await asyncio.to_thread(tempfile.mkdtemp, prefix="muster-fr-")
            env[DIAG_DIR_ENV] = self.diag_dir
        self.kernel_log = await asyncio.to_thread(KernelLog)  # what the kernel says from now on
        self.release_port()  # node 0: torchrun's store binds it next
        try:
            self.proc = await self.spawn(
                *argv,
                cwd=run_dir,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
                preexec_fn=_before_exec(self.group, self.guarded),
            )
        except BaseException:
            if self.diag_dir is not None:  # (nothing will serve there)
                shutil.rmtree(self.diag_dir, True)
            raise
        if self.group is not None and not await asyncio.to_thread(
            cgroup.member_of, self.proc.pid, self.group
        ):
            # The gang's rules are keyed on the group: outside it the ranks would be unguarded
            # (private path), or their own connections into the gang's mesh dropped and the
            # job hung (direct path). Fail it now, saying why.
            why = f"torchrun did not start in its cgroup {self.group.path}"
            log.error("job %s: %s", self.job, why)
            self.stopping = self.stopping or why
        reaper = asyncio.create_task(self._reaper(self.proc.pid))
        await self.send(Kind.MEMBER_STARTED, {**self.ids(), "pid": self.proc.pid})
        if self.stopping:
            # A STOP that came while torchrun was being spawned found no process to end:
            # end it now, so no rank outlives its job.
            self._stop_task = asyncio.create_task(self._end_tree(self.stopping))
        ranks = rank_plan(self.spec).nodes[self.node].ranks
        tailer = RankTailer(capture_dir, ranks.start, len(ranks), self.emit)
        assert self.proc.stdout is not None
        assert self.proc.stderr is not None
        pumps = [
            asyncio.create_task(self._pump(self.proc.stdout, "stdout")),
            asyncio.create_task(self._pump(self.proc.stderr, "stderr")),
        ]
        wait = asyncio.create_task(self.proc.wait())
        watch = None
        if self.spec.hang_timeout:
            watch = HangWatch(float(self.spec.hang_timeout), time.monotonic())
        seen, unread, next_check = 0, False, time.monotonic() + CHECK_EVERY_S
        grew, grew_at = 0, time.monotonic()
        while not wait.done():
            if self.may_read():  # else the lines wait in the rank files on disk
                tailer.poll()
            else:
                unread = True  # not reading is not silence
            if tailer.bytes_read != grew:
                grew, grew_at = tailer.bytes_read, time.monotonic()
            if watch is not None and time.monotonic() >= next_check:
                output = -1 if unread else tailer.bytes_read - seen
                await self._check_hang(watch, output, ranks)
                seen, unread = tailer.bytes_read, False
                next_check = time.monotonic() + CHECK_EVERY_S
            # Fast while the ranks print, slower once they are quiet (an agent beside
            # ranks that print nothing does next to nothing); the exit is seen at once.
            quiet = time.monotonic() - grew_at > QUIET_AFTER_S
            await asyncio.wait([wait], timeout=QUIET_POLL_S if quiet else POLL_S)
        # torchrun is gone; a rank it left behind (torchrun killed by the OOM killer, say)
        # still holds its GPU: end the rest of its process group before reporting the exit.
        await asyncio.to_thread(sweep_group, self.proc.pid, self.grace)
        if self.diag_dir is not None:
            await asyncio.to_thread(shutil.rmtree, self.diag_dir, True)
        await asyncio.gather(*pumps, return_exceptions=True)
        reaper.cancel()
        tailer.poll(final=True)
        await self._report_exit(self.proc.returncode or 0, tailer)
        await self._upload(out_dir)

    async def _check_hang(self, watch: HangWatch, output: int, ranks: range) -> None:
        """HUNG to the controller when this member turns silent and idle, or stops being
        (kept, and sent again on every new link, while it holds)."""
        assert self.proc is not None
        cpu = await asyncio.to_thread(tree_cpu_seconds, self.proc.pid, False)
        now = time.monotonic()
        flipped = watch.observe(now, output, cpu, len(ranks))
        if flipped is None:
            return
        silent = round(watch.silent_for(now))
        log.warning(
            "job %s: ranks %d-%d %s",
            self.job,
            ranks.start,
            ranks.stop - 1,
            f"printed nothing and used no CPU for {silent}s" if flipped else "are active again",
        )
        body = {"hung": flipped, "ranks": [ranks.start, ranks.stop - 1], "silent_s": silent}
        self.hung_report = {**self.ids(), **body} if flipped else None
        self._in_background(self.send(Kind.HUNG, {**self.ids(), **body}))

    async def _reaper(self, pid: int) -> None:
        """Start the watchdog a moment after torchrun, so the two do not compete for the CPU
        while torchrun starts; until then PDEATHSIG covers an agent that dies."""
        await asyncio.sleep(REAPER_DELAY_S)
        watchdog = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "muster.agent.reaper",
            str(os.getpid()),
            str(pid),
            str(self.grace),
            str(self.alive_file or ""),
            str(self.watchdog_timeout),
            stdin=asyncio.subprocess.DEVNULL,
            start_new_session=True,
        )
        await watchdog.wait()

    async def _report_exit(self, code: int, tailer: RankTailer) -> None:
        failed_rank, failed_exit, sig = root_cause(list(self.launcher_lines))
        if code < 0:
            sig = signal.Signals(-code).name
        if self.stopping and code != 0 and sig is None:
            sig = "SIGTERM"
        tail: list[str] = []
        if failed_rank is not None and failed_rank in tailer.tails:
            tail = list(tailer.tails[failed_rank])
        elif code != 0:
            tail = list(self.launcher_lines)[-20:]
        killed = sig == "SIGKILL" or failed_exit == -9 or code == -9
        if killed and not self.stopping and self.kernel_log is not None:
            # Killed with no word of its own: the kernel's log says whether the OOM killer
            # did it (where the agent may read it), and the failure catalogue names it.
            pids = failed_pids(list(self.launcher_lines)) | {self.proc.pid if self.proc else 0}
            texts = await asyncio.to_thread(self.kernel_log.read_new)
            tail += kernel_oom_lines(texts, pids)
        if self.kernel_log is not None:
            self.kernel_log.close()
        # Every line first, then the exit: a job the controller calls over has all of its
        # output stored (`muster logs` right after success misses nothing). Bounded, and
        # not while the link is down (the lines and the report wait for the next one alike).
        deadline = time.monotonic() + LOGS_DRAIN_S
        while self.logs_held() and self.link_up.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self._exited(
            {
                "exit_code": code,
                "signal": sig,
                "failed_rank": failed_rank,
                "failed_exit": failed_exit,
                "tail": tail,
            }
        )

    async def _exited(self, details: dict[str, Any]) -> None:
        self.exit_code = int(details["exit_code"])
        self.signal = details.get("signal")
        await self.report(Kind.MEMBER_EXITED, {**self.ids(), **details})

    async def report(self, kind: Kind, body: dict[str, Any]) -> None:
        """Send a report the controller must get; it is kept until acked (REPORT_ACK)."""
        self.unacked[kind] = body
        await self.send(kind, body)

    async def resend(self) -> None:
        """On a new link: the reports not acked yet, in their order; and that its ranks are
        hung, if they are (a restarted controller knows nothing of it)."""
        for kind, body in list(self.unacked.items()):
            await self.send(kind, body)
        if self.hung_report is not None:
            await self.send(Kind.HUNG, self.hung_report)

    def _in_background(self, work: Awaitable[object]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def acked(self, kind: Kind) -> None:
        self.unacked.pop(kind, None)

    @property
    def settled(self) -> bool:
        """Over, and the controller has acked every report: the agent may forget it."""
        return self.finished and not self.unacked

    def report_for_inventory(self) -> dict[str, Any]:
        """What the agent says of this member when it dials in (see muster.gang.LinkBack)."""
        return {**self.ids(), "exit_code": self.exit_code, "signal": self.signal}

    async def _pump(self, stream: asyncio.StreamReader, name: str) -> None:
        while True:
            raw = await stream.readline()
            if not raw:
                return
            self._launcher_line(name, raw.rstrip(b"\r\n"))

    def _launcher_line(self, stream: str, text: str | bytes) -> None:
        """One line of torchrun's own output (or muster's about the member), kept losslessly."""
        data = text.encode() if isinstance(text, str) else text
        self._launcher_seq += 1
        line = line_fields("node", self.node, self._launcher_seq, time.time(), stream, data)
        self.launcher_lines.append(line[5])
        self.emit([line])

    async def _fetch_bundle(self, run_dir: Path) -> None:
        response = await self.http.get(f"/v1/bundles/{self.bundle}")
        if response.status_code != 200:
            raise InfrastructureError(f"bundle {self.bundle}: HTTP {response.status_code}")
        data = response.content
        if hashlib.sha256(data).hexdigest() != self.bundle:
            raise InfrastructureError(f"bundle {self.bundle}: checksum mismatch")
        await asyncio.to_thread(unpack_bundle, data, run_dir)

    async def _upload(self, out_dir: Path) -> None:
        files: list[str] = []
        errors: list[str] = []
        deadline = time.monotonic() + self.upload_patience
        for path in list_outputs(out_dir):
            rel = path.relative_to(out_dir).as_posix()
            digest = await asyncio.to_thread(_sha256, path)
            while True:
                try:
                    response = await self.http.put(
                        f"/v1/jobs/{self.job}/artifacts/{self.node}/{rel}",
                        content=_read_chunks(path),
                        headers={"X-Muster-Sha256": digest},
                    )
                except httpx.TransportError as exc:
                    # The controller is away (restarting): wait for the agent's next link.
                    if await self._link_back_before(deadline):
                        continue
                    errors.append(f"{rel}: {exc}")
                    break
                except httpx.HTTPError as exc:
                    errors.append(f"{rel}: {exc}")
                    break
                if response.status_code == 401 and await self._link_back_before(deadline):
                    continue  # the ticket of a link that has since ended: a new one comes
                if response.status_code == 201:
                    files.append(rel)
                else:
                    errors.append(f"{rel}: HTTP {response.status_code} {response.text[:200]}")
                break
        for err in errors:
            self._launcher_line("stderr", f"muster: upload failed: {err}")
        await self.report(Kind.ARTIFACTS_DONE, {**self.ids(), "files": files, "errors": errors})

    async def _link_back_before(self, deadline: float) -> bool:
        """Wait (bounded) for the agent's link to be up again; False past ``deadline``."""
        await asyncio.sleep(1.0)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        try:
            await asyncio.wait_for(self.link_up.wait(), remaining)
        except TimeoutError:
            return False
        return True

    async def stop(self, reason: str) -> None:
        """Kill the member's whole process tree: SIGTERM, then SIGKILL after the grace.

        Before torchrun runs, the stop is remembered: the run never starts it, or (when the
        spawn was already under way) ends it the moment it exists.
        """
        if self.stopping:
            return
        self.stopping = reason
        if self.proc is None:
            return
        await self._end_tree(reason)

    async def _end_tree(self, reason: str) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        self._launcher_line("stderr", f"muster: stopping: {reason}")
        # torchrun is this process's child: asyncio reaps it (and keeps its real exit
        # status); only the grandchildren are waited for here.
        signal_tree(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), self.grace)
        except TimeoutError:
            signal_tree(proc.pid, signal.SIGKILL)
        await asyncio.to_thread(kill_tree, proc.pid, self.grace, include_root=False)


def unpack_bundle(data: bytes, dest: Path) -> None:
    """Unpack a source bundle (tar.gz) into ``dest``, refusing anything that would land
    outside it: absolute names, '..', and symbolic or hard links that point out of the
    tree (tarfile's "data" filter), as well as devices and other special files."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            for member in tar.getmembers():
                # The data filter would quietly strip a leading '/': refuse it instead.
                if member.name.startswith("/") or ".." in PurePosixPath(member.name).parts:
                    raise InfrastructureError(
                        f"the bundle is unsafe to unpack: {member.name!r} is not a path "
                        "inside the workdir"
                    )
            tar.extractall(dest, filter="data")
    except tarfile.FilterError as exc:
        raise InfrastructureError(f"the bundle is unsafe to unpack: {exc}") from exc


# Capabilities a gang's ranks lose where the gang's rules guard them: CAP_NET_ADMIN (change
# the rules, set the probe's mark) and CAP_NET_RAW (set a mark since Linux 5.17).
RANK_DROPS = (12, 13)
PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
LINUX_CAPABILITY_VERSION_3 = 0x20080522


def _before_exec(group: RankGroup | None, guarded: bool) -> Callable[[], None]:
    def before() -> None:
        _term_with_parent()
        if group is not None:
            cgroup.join(group.procs)
        if guarded:
            _drop_net_caps()

    return before


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _drop_net_caps() -> None:
    """In the child before exec: torchrun and its ranks never hold the network capabilities
    of the agent. A root child gets, at exec, its inheritable set and its bounding set: both
    lose them (and the ambient set is cleared). Without CAP_SETPCAP the bounding set cannot
    shrink: the child says so on stderr (the member's log), and runs on."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
        kept = [cap for cap in RANK_DROPS if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0]
        header = _CapHeader(LINUX_CAPABILITY_VERSION_3, 0)
        data = (_CapData * 2)()
        if libc.capget(ctypes.byref(header), data) == 0:
            for cap in RANK_DROPS:
                data[cap // 32].inheritable &= ~(1 << (cap % 32))
            if libc.capset(ctypes.byref(header), data) != 0:
                kept = list(RANK_DROPS)
        if kept and os.geteuid() == 0:
            os.write(
                2,
                b"muster: the ranks keep CAP_NET_ADMIN/CAP_NET_RAW (the agent has no "
                b"CAP_SETPCAP): they could change the gang's firewall rules\n",
            )
    except (OSError, AttributeError):
        pass


def _term_with_parent() -> None:
    """In the child before exec: SIGTERM torchrun if the agent dies, even by SIGKILL, so that
    torchrun stops its ranks (Linux prctl PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)


def signal_tree(pid: int, sig: int) -> None:
    """Send ``sig`` to the process's group and to every descendant it has now."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
    try:
        family = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for proc in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(sig)


def sweep_group(pgid: int, grace: float, poll: float = 0.1) -> None:
    """SIGTERM whatever is left in the process group ``pgid``; SIGKILL it after ``grace``."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return  # nothing left (the usual case)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(poll)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def kill_tree(pid: int, grace: float, *, include_root: bool = True) -> None:
    """SIGTERM the process, its group and every descendant; SIGKILL what is left after grace.

    With ``include_root=False`` the root is left to its parent to reap (waiting on it here
    would reap it first, and its parent would then read exit status 255).
    """
    try:
        root = psutil.Process(pid)
        family = [root, *root.children(recursive=True)] if include_root else root.children(True)
    except psutil.NoSuchProcess:
        family = []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGTERM)
    terminate(family, grace)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


async def _read_chunks(path: Path) -> AsyncIterator[bytes]:
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            yield chunk
