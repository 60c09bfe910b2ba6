"""The controller's UDP reflector: a member learns its public endpoint; nobody gets more
bytes back than they sent."""

from __future__ import annotations

import asyncio
import socket

from muster.controller.metrics import Metrics
from muster.controller.reflector import start_reflector
from muster.net.endpoint import REQUEST, public_endpoint


def test_a_member_learns_the_address_and_port_the_reflector_saw() -> None:
    async def scenario() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        transport = await start_reflector("127.0.0.1", port, Metrics())
        assert transport is not None
        try:
            local, seen = await asyncio.to_thread(public_endpoint, ("127.0.0.1", port))
            assert seen == ("127.0.0.1", local)

            # A question smaller than its answer, or not a question, gets nothing back.
            def ask(data: bytes, wait: float = 0.5) -> bytes | None:
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                    s.settimeout(wait)
                    s.sendto(data, ("127.0.0.1", port))
                    try:
                        return s.recv(512)
                    except TimeoutError:
                        return None

            assert await asyncio.to_thread(ask, REQUEST + b"n1") is None
            assert await asyncio.to_thread(ask, b"x" * 100) is None
            big = (REQUEST + b"n2 ").ljust(100, b"x")
            answer = await asyncio.to_thread(ask, big, 5.0)
            assert answer is not None
            assert answer.startswith(b"muster-reflected n2 127.0.0.1 ")
            assert len(answer) <= len(big)
        finally:
            transport.close()

    asyncio.run(scenario())


def test_no_reflector_means_no_public_endpoint_within_a_bound() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:
        silent.bind(("127.0.0.1", 0))  # nobody answers here
        local, seen = public_endpoint(("127.0.0.1", silent.getsockname()[1]))
    assert seen is None
    assert local > 0
