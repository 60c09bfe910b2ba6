"""Node 0's held rendezvous port and every member's check of it (muster.agent.rendezvous),
with real sockets and the real job Python."""

from __future__ import annotations

import asyncio
import socket
import sys

import pytest

from muster.agent.rendezvous import Holds, check, dial, versions


def _bind(port: int) -> socket.socket:
    """What torchrun's store does with the port next (libuv sets SO_REUSEADDR)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", port))
    sock.listen()
    return sock


def test_a_held_port_takes_connections_and_torchrun_binds_it_once_let_go() -> None:
    async def scenario() -> None:
        holds = Holds()
        port = await holds.hold("job1", 1, "127.0.0.1", None)
        assert await holds.hold("job1", 1, "127.0.0.1", None) == port, (
            "the same epoch, the same port"
        )
        for _ in range(200):  # every member of a large gang dials: more than a backlog
            assert await dial("127.0.0.1", port, within=5) is None
        with pytest.raises(OSError, match="Address already in use"):
            _bind(port)  # nobody else takes it meanwhile
        holds.release("job1", 2)  # another epoch's release leaves it
        assert holds.held("job1") == port
        holds.release("job1", 1)
        _bind(port).close()  # free at once: no TIME_WAIT of the checks here
        assert holds.held("job1") is None

    asyncio.run(scenario())


def test_a_newer_epoch_lets_the_old_port_go_and_a_taken_fixed_port_is_refused() -> None:
    async def scenario() -> None:
        holds = Holds()
        old = await holds.hold("job1", 1, "127.0.0.1", None)
        new = await holds.hold("job1", 2, "127.0.0.1", None)
        _bind(old).close()
        taken = _bind(0)
        with pytest.raises(OSError, match="Address already in use"):
            await holds.hold("job2", 1, "127.0.0.1", taken.getsockname()[1])
        taken.close()
        holds.release_all()
        _bind(new).close()

    asyncio.run(scenario())


def test_a_dial_nobody_answers_says_why_within_its_bound() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    loop_time = asyncio.run(_timed(dial("127.0.0.1", port, within=1.0)))
    why, took = loop_time
    assert why == "Connection refused", why
    assert 0.9 <= took < 3.0, took


async def _timed(work: object) -> tuple[object, float]:
    loop = asyncio.get_running_loop()
    start = loop.time()
    result = await work  # type: ignore[misc]
    return result, loop.time() - start


def test_the_versions_are_read_from_the_job_python_without_importing_torch() -> None:
    import torch

    found = asyncio.run(versions(sys.executable))
    assert found["torch"] == torch.__version__.split("+")[0]
    assert found["nccl"] is None, "the CPU build brings no nvidia-nccl wheel"
    missing = asyncio.run(versions("/nonexistent/python"))
    assert missing == {"torch": None, "nccl": None}
    answer = asyncio.run(check(sys.executable, None, 1))
    assert answer["error"] is None, "node 0 does not dial"
