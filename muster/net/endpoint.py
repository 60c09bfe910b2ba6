"""A member's public UDP endpoint, as the controller's reflector sees it (NAT traversal).

The agent picks the UDP port its WireGuard device will listen on, asks the reflector on the
controller's port number from that very port, and so learns the address and port a NAT maps
it to. Linux masquerade (and most home routers) keep that mapping for other destinations, so
the peers reach the device there once both sides send at once, which they do: every member
sets its peers on the same NET_PEERS round and WireGuard's keepalive starts at once.
"""

from __future__ import annotations

import contextlib
import ipaddress
import secrets
import socket

REQUEST = b"muster-reflect "
REPLY = b"muster-reflected "
REQUEST_SIZE = 120  # padded: the reflector never answers with more than it was sent
TRIES = 4
WAIT_S = 0.5


def public_endpoint(server: tuple[str, int]) -> tuple[int, tuple[str, int] | None]:
    """A free local UDP port, and how ``server`` saw a datagram from it (None: no answer)."""
    host, port = server
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError:
        infos = []
    family = infos[0][0] if infos else socket.AF_INET
    target = infos[0][4][:2] if infos else (host, port)
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
        local = int(sock.getsockname()[1])
        if not infos:
            return local, None
        nonce = secrets.token_hex(8).encode()
        request = (REQUEST + nonce + b" ").ljust(REQUEST_SIZE, b"x")
        sock.settimeout(WAIT_S)
        for _ in range(TRIES):
            with contextlib.suppress(OSError):
                sock.sendto(request, target)
            try:
                while True:
                    data, sender = sock.recvfrom(256)
                    seen = _parse(data, nonce)
                    if seen is not None and sender[:2] == target:
                        return local, seen
            except OSError:  # timed out: send again
                continue
        return local, None
    finally:
        sock.close()


def _parse(data: bytes, nonce: bytes) -> tuple[str, int] | None:
    parts = data[len(REPLY) :].split() if data.startswith(REPLY) else []
    if len(parts) != 3 or parts[0] != nonce:
        return None
    try:
        address = str(ipaddress.ip_address(parts[1].decode()))
        port = int(parts[2])
    except (UnicodeDecodeError, ValueError):
        return None
    return (address, port) if 0 < port < 65536 else None
