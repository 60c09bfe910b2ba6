"""Device names are claimed per network namespace, so two agents on one host never share
(or remove) one device (muster.net.wireguard.claim_device)."""

from __future__ import annotations

from pathlib import Path

import pytest

from muster.errors import InfrastructureError, UserError
from muster.net.wireguard import Device, claim_device, foreign_interface


def test_a_second_claim_takes_the_next_free_name_and_a_taken_name_is_refused() -> None:
    first, held = claim_device()
    try:
        second, held2 = claim_device()
        try:
            assert first != second
            assert first.startswith("muster")
            assert second.startswith("muster")
            with pytest.raises(UserError, match=f"device {first} is used by another"):
                claim_device(first)
        finally:
            held2.close()
    finally:
        held.close()
    # Released (the agent ended): the name is free again.
    again, held = claim_device(first)
    held.close()
    assert again == first


@pytest.mark.parametrize("name", ["", "a" * 16, "bad name", "..", "x/y"])
def test_a_name_linux_would_refuse_is_refused_by_name(name: str) -> None:
    if not name:  # empty means "pick one"
        picked, held = claim_device(name or None)
        held.close()
        assert picked.startswith("muster")
        return
    with pytest.raises(UserError, match="an interface name is 1-15"):
        claim_device(name)


def test_a_name_another_interface_has_is_never_claimed_nor_removed() -> None:
    """`--device lo` (or eth0, docker0): the agent refuses it at start, and a device made
    under that name would never delete the host's interface."""
    with pytest.raises(UserError, match="--device lo: this host has an interface"):
        claim_device("lo")
    with pytest.raises(InfrastructureError, match="lo is an interface of this host that muster"):
        Device("lo").up("100.64.0.1", 22)
    Device("lo").down()
    assert Path("/sys/class/net/lo").exists()


def test_only_an_interface_muster_marked_is_its_own(tmp_path: Path) -> None:
    """A VPN's WireGuard (wg0) or TUN device (tailscale0) is someone else's: only the alias
    muster sets on the devices it makes lets it reclaim or remove one."""
    for name, alias in (("wg0", ""), ("tailscale0", "tailscale"), ("muster0", "muster")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "ifalias").write_text(alias + "\n")
    assert foreign_interface("wg0", tmp_path)
    assert foreign_interface("tailscale0", tmp_path)
    assert not foreign_interface("muster0", tmp_path)
    assert not foreign_interface("muster1", tmp_path)  # no such interface: free


def test_an_uplink_it_cannot_tell_is_unknown() -> None:
    """The direct path's device then keeps 1280 (muster.plan.device_mtu)."""
    from muster.net.wireguard import uplink_mtu

    assert uplink_mtu("127.0.0.1") is None  # a controller on this host: says nothing
    assert uplink_mtu("no-such-host.invalid") is None


def test_the_loopback_or_a_missing_interface_says_nothing_of_the_uplink() -> None:
    from muster.net.wireguard import interface_mtu

    assert interface_mtu("lo") is None
    assert interface_mtu("no-such-if0") is None
