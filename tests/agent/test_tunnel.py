"""The ssh forward's command line: never a prompt, a forward that fails ends it, the target
parsed as ssh writes it (the real thing: tests/e2e/test_join_ssh.py)."""

from __future__ import annotations

import asyncio

import pytest

from muster.agent.tunnel import SshTunnel
from muster.errors import InfrastructureError, UserError


def test_the_forward_never_prompts_and_keeps_its_local_port() -> None:
    tunnel = SshTunnel("joiner@ctrl.example.com:2222", "127.0.0.1", 7070, options=["A=b"])
    argv = tunnel.argv()
    assert argv[:2] == ["ssh", "-N"]
    assert "BatchMode=yes" in argv
    assert "ExitOnForwardFailure=yes" in argv
    assert argv[argv.index("-p") + 1] == "2222"
    assert argv[argv.index("-L") + 1] == f"127.0.0.1:{tunnel.local_port}:127.0.0.1:7070"
    assert argv[-2:] == ["--", "joiner@ctrl.example.com"]  # never read as an option
    assert tunnel.url("http") == f"http://127.0.0.1:{tunnel.local_port}"
    assert tunnel.argv() == argv  # the same local port on every dial


@pytest.mark.parametrize("target", ["", "a b", "user@host:notaport", "host:70000"])
def test_a_target_ssh_would_not_take_is_refused_by_name(target: str) -> None:
    with pytest.raises(UserError, match="--ssh"):
        SshTunnel(target, "127.0.0.1", 7070)


def test_a_forward_that_cannot_come_up_says_what_ssh_said() -> None:
    tunnel = SshTunnel("nobody@127.0.0.1:1", "127.0.0.1", 7070)  # nothing listens on port 1

    async def dial() -> None:
        await tunnel.open(timeout=15)

    with pytest.raises(InfrastructureError) as refused:
        asyncio.run(dial())
    assert "ssh to nobody@127.0.0.1:1 could not forward" in str(refused.value)
    assert "Connection refused" in str(refused.value)  # ssh's own words
