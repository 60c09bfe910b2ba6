"""Named failures: what a failed rank's last lines and exit status say, and the fix.

One table, ``CATALOGUE``: each entry is a name, a pattern over the blamed rank's last lines
(or, for a signal, the way it ended) and the fix a user can act on. The root cause of a failed
job (``muster describe``, the dashboard, the SDK's ``JobFailed``) carries the first entry that
matches, read from the newest line back, so the line closest to the failure decides. Pure: no
I/O. Each entry has a test that replays a sample in the real format of the message
(tests/gang/test_catalogue.py); an entry is only added with its sample.

A rank killed with SIGKILL brings the kernel's OOM-killer lines about its pid along where its
agent may read the kernel log (muster.agent.hang.KernelLog); without them a silent SIGKILL is
named as the OOM killer's likely mark. NCCL on TCP sockets is no failure of its own, but
where an NCCL collective timed out and the rank's lines carry NCCL's ``Using network Socket``
banner (the line ``muster verify-fabric`` reads) on a path that did not ask for sockets, the
fix says so: a fabric whose plugin did not load turns a collective that fits its timeout
into one that does not. Not here yet: a rank that hung (that is the ``Hung`` condition), the
relayed path's shim not loaded (with the relayed path).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Entry:
    name: str
    pattern: re.Pattern[str]
    what: str  # what happened; ``{group}`` fields filled from the pattern's named groups
    fix: str


@dataclass(frozen=True)
class Diagnosis:
    name: str
    what: str
    fix: str
    line: str  # the line that matched ("" for a signal)

    def text(self) -> str:
        return f"{self.name}: {self.what}\nfix: {self.fix}"


def _entry(name: str, pattern: str, what: str, fix: str) -> Entry:
    return Entry(name, re.compile(pattern), what, fix)


CATALOGUE: tuple[Entry, ...] = (
    _entry(
        "NCCL watchdog timeout",
        r"Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=(?P<seq>\d+), "
        r"OpType=(?P<op>\w+)(?:, NumelIn=(?P<numel>\d+))?",
        "collective {op} number {seq} never completed on this rank",
        "another rank never entered this collective: it died, hangs, or took another code "
        "path (a rank-dependent `if`, an uneven last batch); read the other ranks' last lines "
        "(`muster logs JOB --rank N`). If one step truly takes longer, raise `timeout` in "
        "init_process_group",
    ),
    _entry(
        "gloo collective timed out",
        r"gloo/transport/tcp/[\w.]+:\d+\] Timed out waiting (?P<ms>\d+)ms for (?P<op>\w+) "
        r"operation to complete",
        "a gloo {op} waited {ms} ms for a peer",
        "another rank never reached this collective (it died, hangs or took another code "
        "path); read the other ranks' last lines, or raise `timeout` in init_process_group",
    ),
    _entry(
        "peer rank died mid-collective",
        r"gloo/transport/tcp/[\w.]+:\d+\] (?:Read|Write) error \[?(?P<peer>[^\]\s]+)\]?"
        r"(?::\d+)?: Connection (?:reset by peer|closed by peer)",
        "the connection to the rank at {peer} broke during a collective",
        "that rank's process ended first: its own root cause and last lines say why "
        "(`muster logs JOB --rank N`)",
    ),
    _entry(
        "rendezvous timed out",
        r"The client socket has timed out after (?P<ms>\d+)ms while trying to connect to "
        r"\((?P<host>[^,]+), (?P<port>\d+)\)",
        "this rank waited {ms} ms for the rendezvous at {host}:{port}",
        "node 0's rendezvous address does not route from this node, or a firewall drops it: "
        "check the interface muster advertises (`muster agent --interface`) and that "
        "{host} is reachable from every member",
    ),
    _entry(
        "rendezvous refused",
        r"The client socket has failed to connect to \[?(?P<host>[^\]\s]+)\]?:(?P<port>\d+)"
        r" \(errno: 111 - Connection refused\)",
        "nothing listened on {host}:{port} when this rank connected",
        "node 0's torchrun was gone (its own failure is the real cause: read node 0's lines) "
        "or the address is another host's; do not set MASTER_ADDR/MASTER_PORT in the job",
    ),
    _entry(
        "rendezvous timed out",
        r"RendezvousTimeoutError",
        "torchrun's rendezvous did not complete in time",
        "not every node joined: read the other nodes' torchrun lines (`muster logs JOB --node N`)",
    ),
    _entry(
        "address already in use",
        r"(?:name: EADDRINUSE|\[Errno 98\] Address already in use|"
        r"failed to listen on any local network address\. port: (?P<port>\d+))",
        "a port this rank listens on was taken",
        "another process on the host holds it (a leftover run, a second job binding a fixed "
        "port): let muster pick the rendezvous port, and bind your own servers to port 0",
    ),
    _entry(
        "CUDA out of memory",
        r"(?:OutOfMemoryError: )?CUDA out of memory\.(?: Tried to allocate "
        r"(?P<size>[\d.]+ [KMGT]?i?B))?",
        "a CUDA allocation failed on this rank's GPU",
        "lower the per-GPU batch size or sequence length, enable activation checkpointing "
        "or mixed precision, or check that no other process shares the GPU "
        "(`CUDA_VISIBLE_DEVICES` per rank: muster sets it from --devices)",
    ),
    _entry(
        "two ranks on one GPU",
        r"Duplicate GPU detected : rank (?P<a>\d+) and rank (?P<b>\d+) both on CUDA device",
        "ranks {a} and {b} chose the same GPU",
        "select the device from LOCAL_RANK: `torch.cuda.set_device(int(os.environ"
        "['LOCAL_RANK']))` before init_process_group",
    ),
    _entry(
        "world size or rank mismatch",
        r"Invalid rank (?P<rank>\d+), rank should be in the interval \[0, (?P<top>\d+)\]",
        "rank {rank} was given a world of {top} + 1",
        "do not hard-code num_replicas or world_size: read WORLD_SIZE and RANK from the "
        "environment (torch.distributed.get_world_size())",
    ),
    _entry(
        "killed by the OOM killer",
        r"(?:Killed|Kill) process (?P<pid>\d+) \((?P<name>[^)]*)\)",
        "the kernel's out-of-memory killer ended process {pid} ({name})",
        "the host (or the job's memory cgroup) ran out of memory: fewer dataloader workers or "
        "a smaller prefetch, no per-rank copy of the dataset, or a host with more memory",
    ),
    _entry(
        "a module is missing",
        r"ModuleNotFoundError: No module named '(?P<module>[\w.]+)'",
        "this rank's Python has no module {module}",
        "install it in the Python the agent runs ranks with (`muster agent --python`), or "
        "add it to the job's image",
    ),
)

KILLED = Entry(
    "killed (SIGKILL)",
    re.compile(""),
    "it was killed with SIGKILL, with no error of its own",
    "when nobody stopped it, the kernel's out-of-memory killer did (`dmesg | grep -i "
    "oom` on the host): lower host memory use (dataloader workers, prefetch, a "
    "per-rank copy of the dataset)",
)


# NCCL's banner at init, at NCCL_DEBUG=INFO: the network its collectives use.
SOCKETS_BANNER = re.compile(r"NCCL INFO Using network Socket\b")
SOCKETS_NOTE = (
    "NCCL ran over TCP sockets on this rank (its banner says 'Using network Socket'): where "
    "the hosts have InfiniBand, RoCE, EFA or TCPX, NCCL's plugin for it did not load (the "
    "image's rdma-core or aws-ofi-nccl, NCCL_IB_DISABLE, NCCL_NET), and a collective a fabric "
    "finishes in time can outlast the timeout on TCP; on Kubernetes `muster verify-fabric` "
    "reads every rank's banner"
)
_NCCL_ENTRIES = ("NCCL watchdog timeout",)


def classify(
    tail: Sequence[str], signal: str | None = None, *, sockets_expected: bool = False
) -> Diagnosis | None:
    """The catalogue entry the failure matches: the newest line that any entry matches
    decides (the first entry in table order, on that line); a SIGKILL with no such line
    is the OOM killer's mark. None when nothing is known. An NCCL failure on a rank whose
    lines say NCCL fell back to sockets adds that to the fix, unless the path asked for
    sockets (``sockets_expected``: muster's direct and relayed paths set NCCL_NET=Socket)."""
    found = _classify(tail, signal)
    if (
        found is not None
        and found.name in _NCCL_ENTRIES
        and not sockets_expected
        and any(SOCKETS_BANNER.search(line) for line in tail)
    ):
        found = replace(found, fix=f"{found.fix}. Also: {SOCKETS_NOTE}")
    return found


def _classify(tail: Sequence[str], signal: str | None) -> Diagnosis | None:
    # A Python failure ends with its traceback: read from the last one on, so an error the
    # program caught and logged earlier (an OOM a batch-size finder retried) is not taken
    # for the one that ended it.
    starts = [i for i, line in enumerate(tail) if line.startswith("Traceback (most recent")]
    for line in reversed(tail[starts[-1] :] if starts else tail):
        for entry in CATALOGUE:
            found = entry.pattern.search(line)
            if found is not None:
                groups = {k: v or "?" for k, v in found.groupdict().items()}
                return Diagnosis(
                    entry.name,
                    entry.what.format(**groups),
                    entry.fix.format(**groups),
                    line,
                )
    if signal == "SIGKILL":
        return Diagnosis(KILLED.name, KILLED.what, KILLED.fix, "")
    return None
