"""libmuster-netshim.so in real processes: a connect() to a peer address goes through the
member's SOCKS5 endpoint (here a minimal one, the seam: it dials the requested port on
loopback), every other connect() goes out directly, and the self-test tells a launcher that
loads the shim from one that does not."""

from __future__ import annotations

import contextlib
import shutil
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from muster.net.shim import LIBRARY_NAME, library, self_test

PEER = "10.255.7.9"  # TEST-NET style: no route from here, so only the shim can reach it


class Socks:
    """SOCKS5, no auth, CONNECT only: records what was asked and splices to 127.0.0.1:port
    (or refuses when ``refuse``)."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.asked: list[tuple[str, int]] = []
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            assert conn.recv(3) == b"\x05\x01\x00"
            conn.sendall(b"\x05\x00")
            head = conn.recv(4)
            if head[3] == 1:
                addr = socket.inet_ntop(socket.AF_INET, conn.recv(4))
            else:
                addr = socket.inet_ntop(socket.AF_INET6, conn.recv(16))
            (port,) = struct.unpack("!H", conn.recv(2))
            self.asked.append((addr, port))
            if self.refuse:
                conn.sendall(b"\x05\x05\x00\x01" + bytes(6))
                return
            upstream = socket.create_connection(("127.0.0.1", port))
            conn.sendall(b"\x05\x00\x00\x01" + bytes(6))
            threading.Thread(target=_pipe, args=(upstream, conn), daemon=True).start()
            _pipe(conn, upstream)

    def close(self) -> None:
        self.server.close()


def _pipe(a: socket.socket, b: socket.socket) -> None:
    try:
        while data := a.recv(65536):
            b.sendall(data)
    except OSError:
        pass
    finally:
        for s in (a, b):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def echo() -> Iterator[int]:
    """An echo server on loopback: what a peer's listener is, here."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(65536):
                    conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()[1]
    server.close()


CLIENT = """
import socket, sys
peer, port, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
family = socket.AF_INET6 if ":" in peer else socket.AF_INET
s = socket.socket(family, socket.SOCK_STREAM)
if mode == "nonblocking":
    s.setblocking(False)
    print("connect_ex", s.connect_ex((peer, port)), "blocking", s.getblocking())
    s.setblocking(True)
else:
    try:
        s.connect((peer, port))
    except OSError as exc:
        print("error", type(exc).__name__)
        sys.exit(0)
s.sendall(b"through the shim")
print("echo", s.recv(100).decode())
"""


def run_client(peers: str, socks_port: int, *args: str) -> str:
    env = {
        "LD_PRELOAD": library(),
        "MUSTER_NETSHIM_PEERS": peers,
        "MUSTER_NETSHIM_SOCKS": f"127.0.0.1:{socks_port}",
    }
    done = subprocess.run(
        [sys.executable, "-c", CLIENT, *args], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_peer_connect_goes_through_the_endpoint_and_others_go_direct(echo: int) -> None:
    socks = Socks()
    try:
        out = run_client(f"10.0.0.1,{PEER}", socks.port, PEER, str(echo), "blocking")
        assert out == "echo through the shim"
        assert socks.asked == [(PEER, echo)]
        # loopback is no peer: straight to the echo server, the endpoint never hears of it
        out = run_client(PEER, socks.port, "127.0.0.1", str(echo), "blocking")
        assert out == "echo through the shim"
        assert socks.asked == [(PEER, echo)]
    finally:
        socks.close()


def test_non_blocking_and_v4_mapped_sockets_are_redirected_with_their_flags_kept(
    echo: int,
) -> None:
    socks = Socks()
    try:
        out = run_client(PEER, socks.port, PEER, str(echo), "nonblocking")
        assert out.splitlines() == ["connect_ex 0 blocking False", "echo through the shim"]
        out = run_client(PEER, socks.port, f"::ffff:{PEER}", str(echo), "blocking")
        assert out == "echo through the shim"
        assert socks.asked == [(PEER, echo), (PEER, echo)]
    finally:
        socks.close()


def test_a_refusal_by_the_endpoint_is_a_refused_connection(echo: int) -> None:
    socks = Socks(refuse=True)
    try:
        assert run_client(PEER, socks.port, PEER, str(echo), "blocking") == (
            "error ConnectionRefusedError"
        )
    finally:
        socks.close()


def test_the_self_test_tells_a_launcher_that_loads_it_from_a_static_one(tmp_path: Path) -> None:
    assert self_test(sys.executable, library()) is None
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a static program with")
    source = tmp_path / "static.c"
    source.write_text('#include <stdio.h>\nint main(void) { puts("hello"); return 0; }\n')
    static = tmp_path / "static"
    built = subprocess.run(
        [cc, "-static", "-o", str(static), str(source)], capture_output=True, text=True
    )
    if built.returncode != 0:
        pytest.skip(f"no static libc to link with: {built.stderr[-200:]}")
    why = self_test(str(static), library())
    assert why is not None
    assert f"did not load {LIBRARY_NAME}" in why
    assert "glibc-based image" in why
