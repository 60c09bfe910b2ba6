"""The star's links on loopback, in one process: who may join, what is refused, and every
ceiling (rendezvous, rejected pre-auth connections, heartbeats, the reduce stall)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from muster.errors import CohortLost, CohortStopped
from muster.train.star import StarClient
from muster.train.starhub import Ceilings, Hub
from muster.train.starwire import (
    DOWN,
    UP,
    Codec,
    Kind,
    StarClosed,
    StarRefused,
    client_handshake,
)

SALT = b"s" * 32
QUICK = Ceilings(heartbeat_s=0.2, timeout_s=1.5, stall_s=2.0, idle_s=2.0, max_rejected=1024)


@pytest.fixture
def root() -> Iterator[Hub]:
    hub = Hub(name="root", salt=SALT, ranks={0, 1}, bind="127.0.0.1", ceilings=QUICK)
    yield hub
    hub.close()


def raw(hub: Hub, ranks: list[int], salt: bytes = SALT) -> Codec:
    sock = socket.create_connection(hub.address, timeout=5)
    codec = Codec(sock, send_dir=UP, recv_dir=DOWN)
    client_handshake(codec, salt, ranks)
    return codec


def until(check: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_round_sums_divides_once_and_answers_every_rank(root: Hub) -> None:
    a = StarClient(0, root.address, SALT, QUICK, "f32")
    b = StarClient(1, root.address, SALT, QUICK, "f32")
    root.wait_joined()
    out_a, out_b = torch.empty(3), torch.empty(3)
    pa = a.submit("param", torch.tensor([1.0, 2.0, 3.0]), 3, 1.0, out_a, scale=1.0)
    pb = b.submit("param", torch.tensor([4.0, 5.0, 6.0]), 3, 3.0, out_b, scale=3.0)
    ra, rb = pa.wait(), pb.wait()
    expected = torch.tensor([13.0, 17.0, 21.0]) / 4  # (1*a + 3*b) / (1 + 3)
    assert torch.allclose(out_a, expected)
    assert torch.allclose(out_b, expected)
    assert ra.ranks == rb.ranks == frozenset({0, 1})
    assert ra.mass == 4.0
    # a zero-mass round realizes nothing: both keep their state
    pa = a.submit("param", None, 3, 0.0, out_a)
    pb = b.submit("param", None, 3, 0.0, out_b)
    assert not pa.wait().realized
    assert not pb.wait().realized
    a.close()
    b.close()


def test_a_hello_without_the_salt_is_refused_and_counted(root: Hub) -> None:
    with pytest.raises((StarRefused, StarClosed, OSError)):
        raw(root, [0], salt=b"x" * 32)
    with socket.create_connection(root.address) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"\0" * 64)
        sock.settimeout(5)
        with contextlib.suppress(ConnectionResetError):
            while sock.recv(4096):  # (the hub closes it, saying nothing)
                pass
    until(lambda: root.rejected == 2)
    honest = raw(root, [0])  # an honest rank still joins
    until(lambda: 0 in root.joined)
    honest.sock.close()


def test_a_rank_cannot_join_for_another_or_twice(root: Hub) -> None:
    first = raw(root, [0])
    with pytest.raises((StarRefused, StarClosed, OSError)):
        raw(root, [0])  # rank 0 is in already
    with pytest.raises((StarRefused, StarClosed, OSError)):
        raw(root, [7])  # not this cohort's
    until(lambda: root.rejected == 2)
    first.sock.close()


class _Flip:
    """A socket whose next frame's tag gets one bit flipped on the way out."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.armed = False

    def sendall(self, data: bytes) -> None:
        if self.armed and len(data) == 16:  # (the tag goes out on its own)
            data = bytes([data[0] ^ 1]) + data[1:]
            self.armed = False
        self.sock.sendall(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


def test_a_forged_frame_breaks_the_link_and_its_rank_is_dead(root: Hub) -> None:
    codec = raw(root, [1])
    until(lambda: 1 in root.joined)
    flip = _Flip(codec.sock)
    codec.sock = flip  # type: ignore[assignment]
    flip.armed = True
    codec.send(Kind.HEARTBEAT)
    until(lambda: 1 in root.dead)
    assert "forged" in root.dead[1]


def test_a_replayed_frame_is_refused(root: Hub) -> None:
    codec = raw(root, [1])
    until(lambda: 1 in root.joined)
    codec.send(Kind.HEARTBEAT)  # seq 1
    codec.send_seq -= 1
    codec.send(Kind.HEARTBEAT)  # the same bytes again: seq 1, its valid tag
    until(lambda: 1 in root.dead)
    assert "replayed" in root.dead[1]


def test_a_thousand_rejected_connections_abort_the_listener() -> None:
    hub = Hub(name="root", salt=SALT, ranks={0}, bind="127.0.0.1", ceilings=QUICK)
    try:
        for _ in range(1024):
            try:
                with socket.create_connection(hub.address, timeout=5) as sock:
                    sock.sendall(b"\xff" * 64)
                    sock.settimeout(5)
                    with contextlib.suppress(OSError):
                        sock.recv(64)
            except OSError:
                break  # (the listener closed)
        until(lambda: hub.failure is not None)
        assert "refused 1024 connections" in str(hub.failure)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(hub.address, timeout=2).close()
    finally:
        hub.close()


def test_a_rendezvous_with_no_new_rank_aborts_naming_who_is_missing(root: Hub) -> None:
    raw(root, [0])
    started = time.monotonic()
    with pytest.raises(Exception, match=r"ranks \[1\] never joined"):
        root.wait_joined()
    assert time.monotonic() - started < QUICK.idle_s + 2


def test_a_silent_rank_is_declared_dead_and_the_round_goes_on_without_it(root: Hub) -> None:
    a = StarClient(0, root.address, SALT, QUICK, "f32")
    silent = raw(root, [1])  # joins, then says nothing, ever
    root.wait_joined()
    out = torch.empty(2)
    result = a.submit("param", torch.tensor([2.0, 4.0]), 2, 1.0, out).wait()
    assert result.ranks == frozenset({0})  # finalized without rank 1
    assert torch.allclose(out, torch.tensor([2.0, 4.0]))
    assert "heartbeat" in root.dead[1]
    until(lambda: 1 in a.dead)  # and everyone is told
    a.close()
    silent.sock.close()


def test_a_stalled_reduce_stops_the_cohort_with_the_reason(root: Hub) -> None:
    a = StarClient(0, root.address, SALT, QUICK, "f32")
    b = StarClient(1, root.address, SALT, QUICK, "f32")  # alive (heartbeats), never contributes
    root.wait_joined()
    pending = a.submit("param", torch.tensor([1.0]), 1, 1.0, torch.empty(1))
    started = time.monotonic()
    with pytest.raises(CohortStopped, match=r"stalled.*ranks \[1\]"):
        pending.wait()
    assert QUICK.stall <= time.monotonic() - started + 0.5 < QUICK.stall + 5
    until(lambda: b.stopped is not None)  # the idle rank is told too
    with pytest.raises(CohortStopped):
        b.check()


def test_a_rank_whose_fold_dies_knows_it_is_out(root: Hub) -> None:
    a = StarClient(0, root.address, SALT, QUICK, "f32")
    root.close()
    until(lambda: a.lost is not None)
    with pytest.raises(CohortLost, match="fold"):
        a.check()


def test_a_contribution_cut_midway_realizes_nothing(root: Hub) -> None:
    """A child that dies mid-contribution leaves part of its values in the sum: that op
    answers "not realized" (everyone keeps its state), and the next op is whole."""
    a = StarClient(0, root.address, SALT, QUICK, "f32")
    codec = raw(root, [1])
    root.wait_joined()
    n = 3 << 20  # (more than one chunk)
    lock = threading.Lock()
    with lock:
        codec.send(Kind.START, op=0, mass=1.0, meta={"what": "param", "n": n, "ranks": [1],
                                                     "wire": "f32", "declared": False})  # fmt: skip
        body = torch.ones(1 << 20).view(torch.uint8).numpy()
        codec.send(Kind.CHUNK, op=0, offset=0, body=memoryview(body.data))
    codec.sock.close()
    out = torch.empty(n)
    result = a.submit("param", torch.full((n,), 2.0), n, 1.0, out).wait()
    assert not result.realized
    result = a.submit("param", torch.full((n,), 2.0), n, 1.0, out).wait()
    assert result.realized
    assert float(out[0]) == 2.0
    a.close()


def test_a_handshake_that_dribbles_is_cut_at_its_deadline(
    root: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    import muster.train.starhub as starhub

    monkeypatch.setattr(starhub, "HANDSHAKE_S", 1.0)
    with socket.create_connection(root.address, timeout=5) as sock:
        started = time.monotonic()
        with contextlib.suppress(OSError):
            for _ in range(30):  # a byte every 0.2 s: each read alone would be in time
                sock.sendall(b"M")
                time.sleep(0.2)
        assert time.monotonic() - started < 4
    until(lambda: root.rejected == 1)


def test_a_rank_declared_dead_is_cut_off_and_never_summed(root: Hub) -> None:
    a = StarClient(0, root.address, SALT, QUICK, "f32")
    late = raw(root, [1])
    root.wait_joined()
    until(lambda: 1 in root.dead, timeout=QUICK.timeout_s + 5)  # (it sent no heartbeat)
    with contextlib.suppress(OSError):  # its link is gone: nothing it sends is read
        late.send(Kind.START, op=0, mass=1.0, meta={"what": "param", "n": 1, "ranks": [1],
                                                    "wire": "f32", "declared": False})  # fmt: skip
        late.send(Kind.CHUNK, op=0, body=memoryview(torch.tensor([100.0]).numpy().data))
    out = torch.empty(1)
    result = a.submit("param", torch.tensor([3.0]), 1, 1.0, out).wait()
    assert result.ranks == frozenset({0})
    assert float(out[0]) == 3.0
    a.close()


def test_a_bf16_wire_gives_every_rank_the_same_answer() -> None:
    """Half the bytes on the wire, sums in f32, and one rounding at the root: every rank
    gets the same bits (in-process ranks too: the root rounds before any delivery)."""
    hub = Hub(name="root", salt=SALT, ranks={0, 1}, bind="127.0.0.1", ceilings=QUICK,
              wire="bf16")  # fmt: skip
    try:
        a = StarClient(0, hub.address, SALT, QUICK, "bf16")
        b = StarClient(1, hub.address, SALT, QUICK, "bf16")
        hub.wait_joined()
        n = (1 << 20) + 5  # (two chunks)
        x, y = torch.randn(n), torch.randn(n)
        out_a, out_b = torch.empty(n), torch.empty(n)
        pa = a.submit("param", x, n, 0.5, out_a, scale=0.5)
        pb = b.submit("param", y, n, 0.5, out_b, scale=0.5)
        assert pa.wait().realized
        assert pb.wait().realized
        assert torch.equal(out_a, out_b)
        exact = (x + y) / 2
        assert torch.allclose(out_a, exact, rtol=2e-2, atol=2e-2)  # (bf16: 8 bits of mantissa)
        assert torch.equal(out_a, out_a.to(torch.bfloat16).float())  # rounded to bf16
        sent = a.codec.bytes_sent
        assert sent < n * 2 * 1.01  # half of f32's bytes
        a.close()
        b.close()
    finally:
        hub.close()


def test_a_folds_unix_socket_is_private_and_still_checks_the_salt_and_the_sequence() -> None:
    """A fold's local links skip the per-frame tag; what keeps them sound: a 0700 directory,
    the peer's uid, the handshake's proof, and frames that must come in sequence."""
    import os

    from muster.train.starhub import LOCAL

    hub = Hub(name="fold", salt=SALT, ranks={0, 1}, bind=LOCAL, ceilings=QUICK)
    try:
        assert isinstance(hub.address, str)
        assert os.stat(os.path.dirname(hub.address)).st_mode & 0o777 == 0o700

        def local(salt: bytes) -> Codec:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(5)
            sock.connect(hub.address)
            codec = Codec(sock, send_dir=UP, recv_dir=DOWN)
            assert not codec.tagged
            client_handshake(codec, salt, [0])
            return codec

        with pytest.raises((StarRefused, StarClosed, OSError)):
            local(b"x" * 32)  # (another run's salt)
        codec = local(SALT)
        codec.send_seq += 1  # (a frame skipped: what a replay or an injection looks like)
        codec.send(Kind.HEARTBEAT)
        with pytest.raises((StarClosed, OSError)):
            codec.read()  # the fold cut the link
        until(lambda: 0 in hub.dead)  # (the rank that skipped a frame: declared dead)
        until(lambda: hub.rejected == 1)  # (the bad salt)
    finally:
        hub.close()
    hub = Hub(name="fold", salt=SALT, ranks={0, 1}, bind=LOCAL, ceilings=QUICK)
    try:
        a = StarClient(0, hub.address, SALT, QUICK, "f32")
        b = StarClient(1, hub.address, SALT, QUICK, "f32")
        hub.wait_joined()
        out_a, out_b = torch.empty(2), torch.empty(2)
        pa = a.submit("param", torch.tensor([1.0, 2.0]), 2, 1.0, out_a, scale=1.0)
        pb = b.submit("param", torch.tensor([3.0, 6.0]), 2, 1.0, out_b, scale=1.0)
        pa.wait()
        pb.wait()
        assert torch.allclose(out_a, torch.tensor([2.0, 4.0]))
        assert torch.allclose(out_b, out_a)
        a.close()
        b.close()
    finally:
        hub.close()
    assert not os.path.exists(os.path.dirname(hub.address))  # (removed with the fold)


def test_the_root_admits_only_the_host_groups_the_cohort_formed() -> None:
    """A client holding the salt may still speak only for a whole host group (as form()
    computed them), not for any set of ranks not joined yet."""
    hub = Hub(name="root", salt=SALT, ranks={0, 1, 2}, bind="127.0.0.1", ceilings=QUICK,
              groups=[[0, 1], [2]])  # fmt: skip
    try:
        for ranks in ([0], [1, 2], [0, 1, 2]):
            with pytest.raises((StarRefused, StarClosed, OSError)):
                raw(hub, ranks)
        until(lambda: hub.rejected == 3)  # (the refusal frame can reach the client first)
        raw(hub, [0, 1])  # (a whole group: admitted)
        raw(hub, [2])
        until(lambda: hub.joined == {0, 1, 2})
    finally:
        hub.close()
