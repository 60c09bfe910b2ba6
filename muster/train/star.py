"""The CPU star reduce: muster.train's second averaging backend (seed 002, views 2-7).

Parameters travel over TCP, not through NCCL or gloo collectives: every rank sends its
contribution to its host's **fold** (the host's lowest rank hosts it), each fold
sends one summed host frame to the **root** (rank 0 hosts it), the root divides once by the
accepted mass and the consensus comes back the same way. So a cohort of mixed GPUs (or
vendors, or CPUs) averages without a common collective library, a host's uplink carries the
model once per direction whatever its rank count, and a rank that dies leaves the sum and the
divisor of every later round instead of hanging a collective (``starhub`` has the hubs and
their ceilings).

``torch.distributed`` is used once, at the start: the ranks gather who shares a host (torch-
run's ``GROUP_RANK``, else the host name) and rank 0 hands out the run's salt and its root's
address. After that no collective runs, so the cohort outlives a rank. The root binds
``MASTER_ADDR`` (the address every rank already reaches for the rendezvous), else every
interface. A fold listens on a Unix socket in a directory only its user may enter; its
links' frames carry no tag (no one else can write into an established Unix stream: the
handshake's proof is enough), which takes the MAC off a host's local traffic; links across
hosts tag every frame.

``StarClient`` is a rank's end: one link to its fold, a reader and a heartbeat thread, and
``submit`` / ``Pending.wait`` for one operation at a time (the async mode keeps one in flight
while it trains). ``StarBackend`` is ElChe's: the round (COUNT, PARAM, BUFFER), the sync step
(COUNT, GRAD, step, BUFFER) and the start (rank 0's model to every rank), on flat host copies
of the model (pinned on a GPU, filled with one synchronize; ``bf16_wire`` casts on the device).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from muster.errors import CohortLost, CohortStopped, UserError
from muster.train.collective import (
    HEAD_SLOTS,
    Divergence,
    RoundResult,
    _floating,
    count_head,
    read_count,
)
from muster.train.mass import MAX_GAMMA, gamma_shares, mover_mass
from muster.train.starhub import LOCAL, Ceilings, Hub, read_values, send_values
from muster.train.starwire import (
    DOWN,
    UP,
    Codec,
    Frame,
    Kind,
    StarClosed,
    StarRefused,
    client_handshake,
)


@dataclass
class Result:
    """What the root answered for one operation."""

    ranks: frozenset[int]  # whose contributions it accepted
    mass: float  # their summed mass
    realized: bool  # False: keep the local state (nothing, or a zero mass, was summed)


@dataclass
class Pending:
    """One submitted operation: ``wait`` for its result (in ``target``)."""

    op: int
    target: torch.Tensor | None
    client: StarClient | LocalClient
    done: threading.Event = field(default_factory=threading.Event)
    result: Result | None = None

    def ready(self) -> bool:
        return self.done.is_set()

    def wait(self) -> Result:
        """Bounded: the root's stall ceiling ends a wedged op with SHUTDOWN; a silent fold
        is a lost cohort after the heartbeat timeout; past both, this rank stops itself."""
        client = self.client
        limit = time.monotonic() + client.ceilings.stall + 2 * client.ceilings.timeout_s
        while not self.done.wait(0.2):
            client.check()
            if time.monotonic() > limit:
                raise CohortStopped(
                    f"no answer to the star's op {self.op} in {client.ceilings.stall:.0f} s "
                    "past the stall ceiling: the root is wedged"
                )
        client.check()
        assert self.result is not None
        return self.result


class LocalClient:
    """A rank whose process hosts its host's fold: contributions go straight into the fold's
    accumulator, results are copied out of it (no socket, no MAC, no extra copy)."""

    def __init__(self, rank: int, fold: Hub, ceilings: Ceilings, wire: str) -> None:
        self.rank = rank
        self.fold = fold
        self.ceilings = ceilings
        self.wire = wire
        self.op = 0
        self.pending: Pending | None = None
        self.dead: dict[int, str] = {}
        self.stopped: str | None = None
        self.lost: str | None = None
        self.closed = False
        self.child = fold.attach({rank}, self._deliver)

    def check(self) -> None:
        if self.stopped is not None:
            raise CohortStopped(self.stopped)
        if self.lost is not None:
            raise CohortLost(self.lost)

    def submit(
        self,
        what: str,
        values: torch.Tensor | None,
        n: int,
        mass: float,
        target: torch.Tensor | None,
        *,
        scale: float = 1.0,
        wire: str | None = None,
    ) -> Pending:
        del wire  # (nothing crosses a wire)
        self.check()
        if self.pending is not None and not self.pending.ready():
            raise UserError("the star client has an operation in flight already")
        pending = Pending(self.op, target, self)
        self.pending = pending
        self.op += 1
        meta = {"what": what, "n": n, "ranks": [self.rank]}
        self.fold.contribute(self.child, pending.op, mass, meta, values, scale)
        if self.fold.failure is not None and self.stopped is None:
            self.stopped = self.fold.failure
        return pending

    def _deliver(
        self, kind: Kind, number: int, mass: float, meta: dict[str, Any], values: Any
    ) -> None:
        if kind is Kind.DEAD:
            for rank in meta.get("ranks", []):
                self.dead[int(rank)] = str(meta.get("reason", ""))
        elif kind is Kind.SHUTDOWN:
            self.stopped = str(meta.get("reason", "the cohort stopped"))
        else:
            pending = self.pending
            if pending is None or number != pending.op:
                return
            if kind is Kind.START:
                pending.result = Result(
                    frozenset(int(r) for r in meta.get("ranks", [])),
                    mass,
                    bool(meta.get("realized")),
                )
            elif kind is Kind.CHUNK and pending.target is not None:
                lo = int(meta["offset"])
                pending.target[lo : lo + values.numel()].copy_(values)
            elif kind in (Kind.END, Kind.ABORT) and pending.result is not None:
                if kind is Kind.ABORT:
                    pending.result.realized = False
                pending.done.set()

    def ask_stop(self, reason: str) -> None:
        self.fold.fail(reason)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.fold.leave(self.child)


class StarClient:
    """A rank's link to its host's fold."""

    def __init__(
        self,
        rank: int,
        address: tuple[str, int] | str,
        salt: bytes,
        ceilings: Ceilings,
        wire: str,
    ) -> None:
        self.rank = rank
        self.ceilings = ceilings
        self.wire = wire
        if isinstance(address, str):  # (its host's fold, on a Unix socket)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(ceilings.idle_s)
            try:
                sock.connect(address)
            except OSError:
                sock.close()
                raise
        else:
            sock = socket.create_connection(address, timeout=ceilings.idle_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.codec = Codec(sock, send_dir=UP, recv_dir=DOWN)
        client_handshake(self.codec, salt, [rank])
        sock.settimeout(ceilings.timeout_s)  # (a wedged fold cannot hold a send for ever)
        self.lock = threading.Lock()
        self.op = 0
        self.pending: Pending | None = None
        self.dead: dict[int, str] = {}
        self.stopped: str | None = None  # SHUTDOWN's reason: save and stop
        self.lost: str | None = None  # the link broke: this rank is out of the cohort
        self.seen = time.monotonic()
        self.closed = False
        threading.Thread(target=self._read, name="star-client-read", daemon=True).start()
        threading.Thread(target=self._beat, name="star-client-beat", daemon=True).start()

    def check(self) -> None:
        """Raise what the cohort said: stop with a save, or this rank is out."""
        if self.stopped is not None:
            raise CohortStopped(self.stopped)
        if self.lost is not None:
            raise CohortLost(self.lost)

    def submit(
        self,
        what: str,
        values: torch.Tensor | None,
        n: int,
        mass: float,
        target: torch.Tensor | None,
        *,
        scale: float = 1.0,
        wire: str | None = None,
    ) -> Pending:
        """Send one contribution (``values * scale``; None: a declared zero-mass one); its
        result goes into ``target``. One operation at a time per client."""
        self.check()
        if self.pending is not None and not self.pending.ready():
            raise UserError("the star client has an operation in flight already")
        pending = Pending(self.op, target, self)
        self.pending = pending
        self.op += 1
        meta = {"what": what, "n": n, "ranks": [self.rank]}
        try:
            send_values(
                self.codec, self.lock, pending.op, mass, meta, values, wire or self.wire, scale
            )
        except OSError as exc:
            self._lose(f"the link to this host's fold broke while sending ({exc})")
            self.check()
        return pending

    def _lose(self, why: str) -> None:
        if self.lost is None and self.stopped is None and not self.closed:
            self.lost = why

    def _read(self) -> None:
        try:
            while not self.closed:
                frame = self.codec.read()
                self.seen = time.monotonic()
                self._frame(frame)
        except (StarRefused, StarClosed, OSError) as exc:
            if not self.closed:
                self._lose(
                    f"rank {self.rank}'s link to its host's fold broke ({exc}): the fold's "
                    "rank died, or the cohort declared this rank dead"
                )

    def _frame(self, frame: Frame) -> None:
        if frame.kind is Kind.HEARTBEAT:
            return
        if frame.kind is Kind.DEAD:
            for rank in frame.meta.get("ranks", []):
                self.dead[int(rank)] = str(frame.meta.get("reason", ""))
        elif frame.kind is Kind.SHUTDOWN:
            self.stopped = str(frame.meta.get("reason", "the cohort stopped"))
        elif frame.kind is Kind.ABORT:
            pass  # (an answer aborted before its values began: its START said so already)
        elif frame.kind is Kind.START:
            pending = self.pending
            if pending is None or frame.op != pending.op:
                raise StarRefused(f"a result for op {frame.op}, which this rank did not send")
            target = pending.target
            complete = True
            if not frame.meta.get("declared"):
                if target is None or target.numel() != int(frame.meta["n"]):
                    raise StarRefused(f"a result of {frame.meta.get('n')} values for op {frame.op}")

                def put(offset: int, values: torch.Tensor) -> None:
                    spot = target[offset : offset + values.numel()]
                    if spot.data_ptr() != values.data_ptr():  # (else it landed in place)
                        spot.copy_(values)

                complete = read_values(self.codec, frame, put, self._frame, target)
            pending.result = Result(
                frozenset(int(r) for r in frame.meta.get("ranks", [])),
                frame.mass,
                bool(frame.meta.get("realized")) and complete,
            )
            pending.done.set()
        else:
            raise StarRefused(f"unexpected {frame.kind.name} from the fold")

    def _beat(self) -> None:
        while not self.closed:
            time.sleep(self.ceilings.heartbeat_s)
            if self.closed:
                return
            if time.monotonic() - max(self.seen, self.codec.last_read) > self.ceilings.timeout_s:
                self._lose(f"this host's fold has been silent for {self.ceilings.timeout_s:.0f} s")
                continue
            with contextlib.suppress(OSError), self.lock:
                self.codec.send(Kind.HEARTBEAT)

    def ask_stop(self, reason: str) -> None:
        """Ask the whole cohort to stop with a save (SHUTDOWN up to the root)."""
        with contextlib.suppress(OSError), self.lock:
            self.codec.send(Kind.SHUTDOWN, meta={"reason": reason})

    def close(self) -> None:
        if self.closed:
            return
        with contextlib.suppress(OSError), self.lock:
            self.codec.send(Kind.BYE)
        self.closed = True
        self.codec.cut()


@dataclass
class Star:
    """This rank's share of the star: its client, and the hubs its process hosts."""

    client: StarClient | LocalClient
    fold: Hub | None
    root: Hub | None
    hosts: list[list[int]]  # the cohort's ranks, grouped by host

    def close(self) -> None:
        """Leave; a hub this rank hosts serves its peers until they leave too (bounded)."""
        self.client.close()
        linger = max(60.0, self.client.ceilings.timeout_s)
        for hub in (self.fold, self.root):
            if hub is not None:
                hub.drain(linger)


def _host_key(rank: int, hosts: Sequence[int] | None) -> str:
    if hosts is not None:
        return f"host{hosts[rank]}"
    group = os.environ.get("GROUP_RANK")
    return f"node{group}" if group is not None else socket.gethostname()


def _root_bind() -> tuple[str, str]:
    """(bind, advertise) for the root: MASTER_ADDR when this host holds it."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        with socket.create_server((master, 0)):
            pass
        return master, master
    except OSError:
        return "", master


def form(
    group: Any,
    ceilings: Ceilings,
    wire: str = "f32",
    hosts: Sequence[int] | None = None,
) -> Star:
    """Build the star over an initialized process group (its only use of collectives).
    ``hosts``: which host each rank is on (tests, and a host key the environment lacks);
    by default torchrun's GROUP_RANK, else the host name."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if hosts is not None and len(hosts) != world:
        raise UserError(f"hosts names {len(hosts)} ranks; the cohort has {world}")
    keys: list[Any] = [None] * world
    dist.all_gather_object(keys, _host_key(rank, hosts), group=group)
    order: dict[str, list[int]] = {}
    for r, key in enumerate(keys):
        order.setdefault(str(key), []).append(r)
    mine = order[str(keys[rank])]
    root = None
    offer: list[Any] = [None, None]
    if rank == 0:
        bind, advertise = _root_bind()
        salt = secrets.token_bytes(32)
        root = Hub(name="root", salt=salt, ranks=set(range(world)), bind=bind,
                   ceilings=ceilings, wire=wire,
                   groups=[g for g in order.values() if 0 not in g])  # fmt: skip
        offer = [salt.hex(), [advertise, root.address[1]]]
    dist.broadcast_object_list(offer, src=_global(group, 0), group=group)
    salt = bytes.fromhex(str(offer[0]))
    root_address = (str(offer[1][0]), int(offer[1][1]))
    fold = None
    if rank == mine[0]:  # (rank 0's fold is the root's child in this process: no socket)
        fold = Hub(name=f"fold{len(order)}-{rank}", salt=salt, ranks=set(mine),
                   bind=LOCAL, ceilings=ceilings, wire=wire, groups=[[r] for r in mine[1:]],
                   parent=root if root is not None else root_address)  # fmt: skip
    ports: list[Any] = [None] * world
    dist.all_gather_object(ports, fold.address if fold is not None else None, group=group)
    client: StarClient | LocalClient
    try:
        if fold is not None and root is None:
            fold.connect_parent(*root_address)
        if fold is not None:
            client = LocalClient(rank, fold, ceilings, wire)
        else:
            where = ports[mine[0]]  # (a Unix socket's path, or a loopback (host, port))
            where = str(where) if isinstance(where, str) else (str(where[0]), int(where[1]))
            client = StarClient(rank, where, salt, ceilings, wire)
        if fold is not None:
            fold.wait_joined()
        if root is not None:
            root.wait_joined()
    except (StarClosed, StarRefused, OSError) as exc:
        for hub in (fold, root):
            if hub is not None:
                hub.close()
        raise CohortLost(f"the star reduce could not form: {exc}") from exc
    return Star(client, fold, root, list(order.values()))


def _global(group: Any, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank


@dataclass
class _Flat:
    """A flat host copy of some tensors (f32), filled and written back in one pass each."""

    tensors: list[torch.Tensor]
    host: torch.Tensor
    wire_dtype: torch.dtype

    @classmethod
    def of(cls, tensors: list[torch.Tensor], wire: str) -> _Flat:
        n = sum(t.numel() for t in tensors)
        pin = torch.cuda.is_available() and any(t.is_cuda for t in tensors)
        dtype = torch.bfloat16 if wire == "bf16" else torch.float32
        return cls(tensors, torch.empty(n, dtype=dtype, pin_memory=pin), dtype)

    @property
    def n(self) -> int:
        return int(self.host.numel())

    def snapshot(self) -> torch.Tensor:
        """The tensors into the host copy: cast on the device (bf16 wire), copied without
        waiting, one synchronize at the end on a GPU."""
        offset = 0
        cuda = False
        for tensor in self.tensors:
            n = tensor.numel()
            source = tensor.detach().reshape(-1)
            if source.dtype != self.wire_dtype:
                source = source.to(self.wire_dtype)
            self.host[offset : offset + n].copy_(source, non_blocking=source.is_cuda)
            cuda |= source.is_cuda
            offset += n
        if cuda:
            torch.cuda.synchronize()
        return self.host

    def load(self, values: torch.Tensor, add_from: torch.Tensor | None = None) -> None:
        """Write ``values`` back into the tensors; with ``add_from``, add ``values - add_from``
        instead (the async mode keeps what the rank learned since its snapshot)."""
        offset = 0
        with torch.no_grad():
            for tensor in self.tensors:
                n = tensor.numel()
                part = values[offset : offset + n].view(tensor.shape)
                if add_from is not None:
                    part = part - add_from[offset : offset + n].view(tensor.shape)
                    tensor.add_(part.to(tensor.device, tensor.dtype))
                else:
                    tensor.copy_(part)
                offset += n


class StarBackend:
    """ElChe's averaging through the star: every operation pre-scales at the rank, sums
    through the fold, and is divided once at the root."""

    def __init__(
        self,
        model: nn.Module,
        group: Any,
        *,
        ceilings: Ceilings,
        bf16_wire: bool = False,
        hosts: Sequence[int] | None = None,
    ) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        wire = "bf16" if bf16_wire else "f32"
        self.star = form(group, ceilings, wire, hosts)
        self.client = self.star.client
        self.params = _Flat.of(_floating(model.parameters()), wire)
        self.buffers = _Flat.of(_floating(model.buffers()), wire)
        self.result = torch.empty(max(self.params.n, self.buffers.n, 1), dtype=torch.float32)
        self.alive = set(range(self.world))
        self._last_async: AsyncRound | None = None

    @property
    def dead(self) -> dict[int, str]:
        return dict(self.client.dead)

    def close(self) -> None:
        self.star.close()

    def _run(
        self, what: str, flat: _Flat | None, mass: float, values: torch.Tensor | None = None
    ) -> Result:
        if values is None and flat is not None:
            values = flat.snapshot() if mass > 0 else None
        n = flat.n if flat is not None else (values.numel() if values is not None else 0)
        target = self.result[:n] if n else None
        pending = self.client.submit(
            what, values if mass > 0 else None, n, mass, target, scale=mass
        )
        result = pending.wait()
        self.alive = set(result.ranks) if result.ranks else self.alive
        return result

    def count(
        self, model: nn.Module, batches: int, window: int, in_step: bool, side: torch.Tensor,
        missing: int = 0,
    ) -> tuple[tuple[int, ...], set[int]]:  # fmt: skip
        """COUNT through the star: the ranks' heads summed; checked among the accepted."""
        params, buffers = _floating(model.parameters()), _floating(model.buffers())
        head = count_head(params, buffers, batches, window, in_step, side, self.rank,
                          self.world, missing)  # fmt: skip
        values = torch.tensor(head, dtype=torch.float64)
        target = torch.empty_like(values)
        pending = self.client.submit("count", values, values.numel(), 1.0, target, wire="f64")
        result = pending.wait()
        if not result.realized:  # (a contribution was lost midway: this round is idle)
            return (0,) * self.world, set(result.ranks)
        among = set(result.ranks)
        counted = read_count(target.tolist(), self.rank, self.world, side, among)
        self.alive = among
        return counted.counts, among

    def round(
        self, model: nn.Module, batches: int, gamma: float, side: torch.Tensor, window: int
    ) -> RoundResult:
        if not 0.0 <= gamma <= MAX_GAMMA:
            raise UserError(f"gamma must be between 0 and {MAX_GAMMA:g}; got {gamma!r}")
        counts, among = self.count(model, batches, window, False, side)
        movers = [r for r in among if counts[r] > 0]
        if not movers:
            return RoundResult(False, 1, counts, 0.0, 0, None)
        shares = gamma_shares([counts[r] if r in among else 0 for r in range(self.world)], gamma)
        mine = shares[self.rank]
        local = self.params.snapshot() if self.params.n else None
        result = self._run("param", self.params, mine, values=local if mine > 0 else None)
        divergence = None
        if result.realized and local is not None:
            consensus = self.result[: self.params.n]
            divergence = Divergence(
                float(torch.linalg.vector_norm(local - consensus)),
                float(torch.linalg.vector_norm(local)),
                float(torch.linalg.vector_norm(consensus)),
            )
            self.params.load(consensus)
        collectives = 2
        if self.buffers.n:
            moved = mover_mass(counts[self.rank])
            result = self._run("buffer", self.buffers, moved)
            if result.realized:
                self.buffers.load(self.result[: self.buffers.n])
            collectives += 1
        return RoundResult(True, collectives, counts, mine, len(movers), divergence)

    def step(
        self, model: nn.Module, step: Callable[[], Any], side: torch.Tensor, window: int
    ) -> RoundResult:
        """Sync mode: COUNT, GRAD (the mean gradient of the live ranks, with which of them
        reached each parameter riding along), the optimizer's step, BUFFER."""
        trainable = [p for p in _floating(model.parameters()) if p.requires_grad]
        missing = sum(1 for p in trainable if p.grad is None)
        counts, among = self.count(model, 1, window, True, side, missing)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in trainable]
        reached = torch.tensor([0.0 if p.grad is None else 1.0 for p in trainable])
        flat = _Flat.of(grads, "f32")
        values = torch.cat([flat.snapshot().to(torch.float32), reached])
        target = torch.empty_like(values)
        result = self.client.submit("grad", values, values.numel(), 1.0, target).wait()
        if not result.realized:
            # A contribution was cut off midway (a rank died in it): no rank steps on this
            # batch, so the models stay one (each stepping on its own gradient would not).
            world = max(1, len(among))
            return RoundResult(False, 2, counts, 1.0 / world, world, None)
        if result.realized:
            n = flat.n
            used = target[n:] > 0
            for param, grad, hit in zip(trainable, grads, used.tolist(), strict=True):
                if not hit:
                    param.grad = None
                    continue
                param.grad = grad
            flat.load(target[:n])
        step()
        collectives = 2
        if self.buffers.n:
            result = self._run("buffer", self.buffers, 1.0)
            if result.realized:
                self.buffers.load(self.result[: self.buffers.n])
            collectives += 1
        world = max(1, len(among))
        return RoundResult(True, collectives, counts, 1.0 / world, world, None)

    def start(self, model: nn.Module) -> None:
        """Every rank starts from rank 0's model (its mass 1, every other rank's 0)."""
        both = _Flat.of(_floating(model.parameters()) + _floating(model.buffers()), "f32")
        mass = 1.0 if self.rank == 0 else 0.0
        target = torch.empty(both.n, dtype=torch.float32)
        values = both.snapshot() if mass else None
        result = self.client.submit("start", values, both.n, mass, target).wait()
        if not result.realized:
            raise CohortLost("rank 0 left before the start: there is no model to begin from")
        both.load(target)

    def begin(
        self, model: nn.Module, batches: int, gamma: float, side: torch.Tensor, window: int
    ) -> AsyncRound:
        """Async mode: the round of ``window`` on a thread of its own, from a snapshot taken
        now; the rank trains on and ``AsyncRound.apply`` lands the consensus later."""
        params, buffers = _floating(model.parameters()), _floating(model.buffers())
        head = count_head(params, buffers, batches, window, False, side, self.rank,
                          self.world, 0)  # fmt: skip
        snap = self.params.snapshot().to(torch.float32, copy=True)
        snap_buffers = self.buffers.snapshot().to(torch.float32, copy=True)
        pending = AsyncRound(self, window, batches, gamma, head, side, snap, snap_buffers)
        pending.previous, self._last_async = self._last_async, pending
        pending.thread.start()
        return pending


@dataclass
class AsyncRound:
    """One async round in flight: COUNT, PARAM and BUFFER on its own thread."""

    backend: StarBackend
    window: int
    batches: int
    gamma: float
    head: list[float]
    side: torch.Tensor
    snap: torch.Tensor  # the parameters as sent (f32)
    snap_buffers: torch.Tensor
    counts: tuple[int, ...] = ()
    alive: set[int] = field(default_factory=set)
    params_realized: bool = False
    buffers_realized: bool = False
    share: float = 0.0
    movers: int = 0
    consensus: torch.Tensor | None = None
    consensus_buffers: torch.Tensor | None = None
    error: BaseException | None = None
    previous: AsyncRound | None = None  # (rounds run one after another: one op at a time)
    done: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, name="star-async", daemon=True)

    def ready(self) -> bool:
        return self.done.is_set()

    def _run(self) -> None:
        try:
            self._rounds()
        except BaseException as exc:  # handed to the training thread by ``apply``
            self.error = exc
        finally:
            self.done.set()

    def _rounds(self) -> None:
        backend, client, world = self.backend, self.backend.client, self.backend.world
        previous, self.previous = self.previous, None
        if previous is not None:  # (lookahead > 1: this round's ops follow the last one's)
            while not previous.done.wait(0.2):
                client.check()
            if previous.error is not None:
                raise previous.error
        values = torch.tensor(self.head, dtype=torch.float64)
        target = torch.empty_like(values)
        result = client.submit("count", values, values.numel(), 1.0, target, wire="f64").wait()
        self.alive = set(result.ranks)
        if not result.realized:
            self.counts = (0,) * world
            return
        counted = read_count(target.tolist(), backend.rank, world, self.side, self.alive)
        self.counts = counted.counts
        movers = [r for r in self.alive if self.counts[r] > 0]
        self.movers = len(movers)
        if not movers:
            return
        shares = gamma_shares(
            [self.counts[r] if r in self.alive else 0 for r in range(world)], self.gamma
        )
        self.share = shares[backend.rank]
        if self.snap.numel():
            self.consensus = torch.empty_like(self.snap)
            sent = self.snap if self.share > 0 else None
            result = client.submit(
                "param", sent, self.snap.numel(), self.share, self.consensus, scale=self.share
            ).wait()
            self.params_realized = result.realized
        if self.snap_buffers.numel():
            moved = mover_mass(self.counts[backend.rank])
            self.consensus_buffers = torch.empty_like(self.snap_buffers)
            sent = self.snap_buffers if moved > 0 else None
            result = client.submit(
                "buffer", sent, self.snap_buffers.numel(), moved, self.consensus_buffers,
                scale=moved,
            ).wait()  # fmt: skip
            self.buffers_realized = result.realized

    def apply(self, model: nn.Module) -> RoundResult:
        """On the training thread: wait (bounded, as every op) and land the consensus, the
        parameters as a delta from the snapshot, the buffers as they are."""
        del model  # (the backend's flat views are the model's tensors)
        while not self.done.wait(0.2):
            self.backend.client.check()
        if self.error is not None:
            raise self.error
        divergence = None
        if self.params_realized and self.consensus is not None:
            divergence = Divergence(
                float(torch.linalg.vector_norm(self.snap - self.consensus)),
                float(torch.linalg.vector_norm(self.snap)),
                float(torch.linalg.vector_norm(self.consensus)),
            )
            self.backend.params.load(self.consensus, add_from=self.snap)
        if self.buffers_realized and self.consensus_buffers is not None:
            self.backend.buffers.load(self.consensus_buffers)
        realized = self.params_realized or self.buffers_realized
        return RoundResult(realized, 3, self.counts, self.share, self.movers, divergence)


__all__ = ["HEAD_SLOTS", "AsyncRound", "Ceilings", "Star", "StarBackend", "StarClient", "form"]
