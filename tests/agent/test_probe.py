"""The probe's endpoint and measurements on loopback (the rig tests run it across hosts)."""

from __future__ import annotations

import asyncio
import re
import socket
import time
from pathlib import Path

import pytest

from muster.agent.network import GangNetwork
from muster.net import probe
from muster.net.probe import ProbeListener, measure, probe_peers, steady


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_peer_is_measured_and_a_closed_listener_cuts_what_it_accepted() -> None:
    async def scenario() -> None:
        listener = ProbeListener()
        port = await listener.start("127.0.0.1")
        result = await measure(1, "127.0.0.1", port, 0.3)
        assert result.error is None
        assert result.connects == 3
        assert result.rtt_ms is not None
        assert result.rtt_ms > 0
        assert result.gbps is not None
        assert result.gbps > 0.1
        # An echo connection left open is cut when the listener closes.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"e")
        await writer.drain()
        await asyncio.sleep(0.05)
        await listener.close()
        assert await asyncio.wait_for(reader.read(1), 2) == b""
        writer.close()

    asyncio.run(scenario())


def test_an_address_no_interface_holds_is_served_on_every_address() -> None:
    async def scenario() -> None:
        listener = ProbeListener()
        port = await listener.start("203.0.113.77")  # a NAT's or elastic address
        try:
            assert (await measure(1, "127.0.0.1", port, 0)).error is None
        finally:
            await listener.close()

    asyncio.run(scenario())


def test_a_peer_nobody_listens_for_fails_with_the_count_and_the_reason() -> None:
    results = asyncio.run(probe_peers([(2, "127.0.0.1", free_port())], 0.2, 30))
    assert len(results) == 1
    assert results[0].node == 2
    assert results[0].connects == 0
    assert results[0].error is not None
    assert results[0].error.startswith("0 of 3 connections to 127.0.0.1:")


def test_a_path_that_drops_everything_for_a_while_is_given_the_readiness_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Connections that time out (a WireGuard session that lost its first keys drops
    everything until it shakes hands again) are tried until the window is over; a path
    that heals inside it passes, one that never does fails, naming the tries and the time."""
    monkeypatch.setattr(probe, "CONNECT_TIMEOUT_S", 0.2)
    monkeypatch.setattr(probe, "READINESS_MAX_ATTEMPTS", 20)  # its cap (4 s) is not the window
    real = probe._connect
    dropped = {"left": 4}

    async def blackholed_for_a_while(
        address: str, port: int, timeout: float | None = None
    ) -> object:
        if dropped["left"] > 0:
            dropped["left"] -= 1
            await asyncio.sleep(probe.CONNECT_TIMEOUT_S if timeout is None else timeout)
            raise TimeoutError
        return await real(address, port, timeout)

    monkeypatch.setattr(probe, "_connect", blackholed_for_a_while)

    async def scenario() -> None:
        listener = ProbeListener()
        port = await listener.start("127.0.0.1")
        try:
            # Four tries time out (0.8 s of a 3 s window, room for a busy runner's late
            # wake-ups): the fifth connects.
            healed = await measure(1, "127.0.0.1", port, 0, window=3.0)
            assert healed.error is None, healed
            assert healed.connects == 3
            dropped["left"] = 100  # never heals
            started = time.monotonic()
            broken = await measure(1, "127.0.0.1", port, 0, window=1.0)
            took = time.monotonic() - started
            dropped["left"] = 100
            without = await measure(1, "127.0.0.1", port, 0)  # no window: three tries
        finally:
            await listener.close()
            await asyncio.sleep(0.1)  # the readiness connections' handlers end
        assert broken.connects == 0
        assert broken.error is not None
        # (5 tries of 0.2 s in the 1 s window; fewer when a busy runner wakes them late)
        assert re.match(r"0 of [3-6] connections to 127\.0\.0\.1:", broken.error), broken.error
        assert "TimeoutError" in broken.error
        assert 0.9 < took < 3.0, took  # the window, not the 20-try cap (4 s) nor the first 3 tries
        assert without.error is not None
        assert without.error.startswith("0 of 3 connections"), without.error

    asyncio.run(scenario())


def test_a_sample_too_short_for_the_receiver_to_time_still_gives_a_rate() -> None:
    async def scenario() -> None:
        listener = ProbeListener()
        port = await listener.start("127.0.0.1")
        try:
            result = await measure(1, "127.0.0.1", port, 1e-6)
        finally:
            await listener.close()
        assert result.error is None
        assert result.gbps is not None
        assert result.gbps > 0  # never a 0 Gbit/s that would read as the slowest pair

    asyncio.run(scenario())


def test_an_endpoint_answers_only_connections_that_bring_the_epochs_token() -> None:
    """Another gang (or anyone) reaching a member's probe endpoint is cut before any echo or
    sample; the gang's own members, with the token, are measured."""

    async def scenario() -> None:
        listener = ProbeListener()
        token = bytes.fromhex("00112233445566778899aabbccddeeff")
        port = await listener.start("127.0.0.1", token=token)
        try:
            stranger = await measure(1, "127.0.0.1", port, 0.1, token=bytes(16))
            assert stranger.error is not None
            assert stranger.error.startswith(f"measuring 127.0.0.1:{port}")
            assert listener.refused >= 1
            tokenless = await measure(1, "127.0.0.1", port, 0.1)
            assert tokenless.error is not None
            member = await measure(1, "127.0.0.1", port, 0.1, token=token)
            assert member.error is None
            assert member.gbps is not None
        finally:
            await listener.close()

    asyncio.run(scenario())


def test_rules_are_skipped_not_fatal_for_a_member_advertised_by_host_name(
    tmp_path: Path,
) -> None:
    """Node 0's rendezvous rules need IP addresses; a gang advertised by host name runs
    without them (the agent says so) instead of failing its member."""

    async def scenario() -> None:
        async def send(_kind: object, _body: object) -> bool:
            return True

        network = GangNetwork(send, tmp_path, None, "w0")  # type: ignore[arg-type]
        network.no_rules = None
        await network.guard(
            {
                "job": "j",
                "epoch": 1,
                "node_rank": 0,
                "master_port": 29500,
                "addresses": ["node-a.example", "node-b.example"],
            }
        )
        assert network.firewall.gangs == {}

    asyncio.run(scenario())


def test_closing_the_listener_cuts_a_throughput_sample_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sample is copied in threads; closing the listener (the member assigned or stopped)
    must end it at once, not when the sender's clock runs out."""
    monkeypatch.setattr(probe, "steady", lambda rates: False)  # a link that wanders

    async def scenario() -> None:
        listener = ProbeListener()
        port = await listener.start("127.0.0.1")
        sample = asyncio.create_task(measure(1, "127.0.0.1", port, 20.0))
        await asyncio.sleep(1.5)  # readiness, echo, then well into the 20 s sample
        started = asyncio.get_running_loop().time()
        await listener.close()
        result = await asyncio.wait_for(sample, 10)
        assert asyncio.get_running_loop().time() - started < 8
        assert result.gbps is None
        assert result.error is not None

    asyncio.run(scenario())


def test_a_cancelled_probe_leaves_no_sending_thread_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    """probe_peers' bound cancels a sample: its sending thread ends with it (the agent's
    exit never waits for a sample nobody wants)."""
    monkeypatch.setattr(probe, "steady", lambda rates: False)  # a link that wanders

    async def scenario() -> float:
        listener = ProbeListener()
        port = await listener.start("127.0.0.1")
        loop = asyncio.get_running_loop()
        started = loop.time()
        results = await probe_peers([(1, "127.0.0.1", port)], 30.0, 2.0)
        assert "did not finish within 2s" in str(results[0].error)
        await listener.close()
        return loop.time() - started

    began = asyncio.new_event_loop()
    try:
        took = began.run_until_complete(scenario())
        t0 = began.time()
        began.run_until_complete(began.shutdown_default_executor())  # joins the threads
        assert began.time() - t0 < 5, "a probe thread outlived its bound"
        assert took < 5
    finally:
        began.close()


def test_a_steady_rate_is_one_whose_last_windows_agree_within_the_spread() -> None:
    assert not steady([])
    assert not steady([1.0, 1.0, 1.0])  # too few windows to tell
    assert steady([5.0, 1.0, 1.02, 0.98, 1.0])  # a slow start does not count
    assert not steady([1.0, 1.0, 1.0, 1.2])
    assert not steady([0.0, 0.0, 0.0, 0.0])


# Each quarter-second window 8-12% off a level of 1, never four in a row within 5%.
JITTER = [1.10, 0.90, 1.08, 0.92, 1.12, 0.88, 1.09, 0.91, 1.11, 0.89, 1.10, 0.90] * 2


def test_a_rate_that_jitters_about_a_level_is_steady_once_its_mean_is_known() -> None:
    """A shared host's link: its last four windows never agree within 5%, but within 4 s
    (16 windows; never under 2 s) the mean of its windows is known to 7.5% (a 95%
    t-interval)."""
    assert not any(steady(JITTER[:n]) for n in range(4, 8))  # under 2 s: too soon to tell
    assert steady(JITTER[:16])
    assert steady([0.2, 0.5, 0.8, *JITTER[:16]])  # a ramp, then a level: the level counts


def test_a_rate_that_wanders_ramps_or_drifts_is_sampled_on() -> None:
    """To probe_seconds: no level to report early."""
    wild = [1.4, 0.6, 1.3, 0.7, 1.5, 0.5, 1.35, 0.65] * 2  # 30-50% a window
    assert not any(steady(wild[:n]) for n in range(4, 17))
    climb = [1.0 * 1.04**i for i in range(16)]  # +4% a window: each four within 6%
    assert not any(steady(climb[:n]) for n in range(4, 17))
    ramp = [0.2, 0.4, 0.6, 0.8, 1.0, 1.1, 0.9, 1.1, 0.9]  # still coming up from its start
    assert not steady(ramp)


def test_a_sample_ends_once_its_rate_holds_and_never_past_its_bound() -> None:
    """probe_seconds is the longest a sample may take (default 10 s); loopback holds its rate
    long before that, so the sample ends early with the same kind of answer."""

    async def scenario() -> None:
        listener = ProbeListener()
        port = await listener.start("127.0.0.1")
        try:
            start = time.monotonic()
            long = await measure(1, "127.0.0.1", port, 30.0)
            took = time.monotonic() - start
            start = time.monotonic()
            short = await measure(1, "127.0.0.1", port, 0.5)
            bounded = time.monotonic() - start
        finally:
            await listener.close()
        assert long.error is None
        assert long.gbps is not None
        assert long.gbps > 0.1
        # (a sample that never held its rate runs its 30 s; a busy runner's jitter may keep
        # the rule from ending it at the first chance, so the bound is well past that)
        assert took < 27, f"a 30 s sample on loopback ran {took:.1f} s: it never held its rate"
        assert short.gbps is not None
        assert short.gbps > 0.1
        assert bounded < 4.0  # 0.5 s of sending, plus the connections and the echo

    asyncio.run(scenario())


def test_a_path_that_loses_full_size_packets_fails_at_the_echo_even_without_a_sample(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A peer reached through a path that carries single bytes but loses full-size
    segments (here: a listener that answers the 1-byte rounds and swallows anything
    larger): the pair connects, its RTT is measured, and its 16 KiB echo never comes back,
    which fails the pair with probe_seconds 0 too."""
    monkeypatch.setattr(probe, "CONNECT_TIMEOUT_S", 0.5)

    async def narrow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        kind = await reader.read(1)
        while kind == b"e" and (data := await reader.read(65536)):
            if len(data) == 1:
                writer.write(data)
                await writer.drain()
        writer.close()

    async def scenario() -> None:
        server = await asyncio.start_server(narrow, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            lost = await measure(1, "127.0.0.1", port, 0.0)
        finally:
            server.close()
        assert lost.connects == 3
        assert lost.error is not None
        assert "16 KiB did not come back within 0.5s where single bytes did" in lost.error
        listener = ProbeListener()  # the real listener echoes it whole
        port = await listener.start("127.0.0.1")
        try:
            whole = await measure(1, "127.0.0.1", port, 0.0)
        finally:
            await listener.close()
        assert whole.error is None, whole
        assert whole.rtt_ms is not None

    asyncio.run(scenario())
