"""Where the ranks' cgroup goes (muster.net.cgroup), read from mountinfo and /proc/self/cgroup."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from muster.net.cgroup import Hierarchy, RankGroups, _hierarchy

HYBRID = (
    "31 25 0:26 / /sys/fs/cgroup rw,nosuid - tmpfs tmpfs ro,mode=755\n"
    "33 31 0:28 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
)
ROOT = lambda mount: True  # noqa: E731 (the mounted group is the hierarchy's root)
UNIFIED = "30 25 0:27 / /sys/fs/cgroup rw,nosuid,nodev - cgroup2 cgroup2 rw,nsdelegate\n"


def test_a_hybrid_host_uses_the_unified_mount_and_nft_names_the_path_under_sys_fs_cgroup() -> None:
    found = _hierarchy(HYBRID, "4:memory:/x\n0::/\n", ROOT)
    assert found == Hierarchy(Path("/sys/fs/cgroup/unified"), PurePosixPath("/"))
    group = RankGroups(found, "w1").group("gabc")
    assert group.path.parent == Path("/sys/fs/cgroup/unified")
    assert group.nft_path == f"unified/{group.path.name}"
    assert group.level == 1
    assert group.path.name.startswith("muster-")
    assert group.path.name.endswith("-gabc")


def test_a_service_cgroup_puts_the_group_beside_the_agent_one_level_down() -> None:
    found = _hierarchy(UNIFIED, "0::/system.slice/muster-agent.service\n", ROOT)
    assert isinstance(found, Hierarchy)
    group = RankGroups(found, "w1").group("gabc")
    assert group.path.parent == Path("/sys/fs/cgroup/system.slice/muster-agent.service")
    assert group.nft_path.startswith("system.slice/muster-agent.service/muster-")
    assert group.level == 3
    # Two agents' groups of one gang differ (one host may run two agents).
    assert RankGroups(found, "w2").group("gabc").path != group.path


def test_no_usable_hierarchy_says_why() -> None:
    assert "no cgroup v2" in str(_hierarchy(HYBRID.replace("cgroup2", "cgroup"), "0::/\n"))
    assert "in no cgroup v2" in str(_hierarchy(UNIFIED, "4:memory:/x\n"))
    namespaced = UNIFIED.replace(" / /sys/fs/cgroup", " /kubepods/pod1 /sys/fs/cgroup")
    assert "cgroup namespace" in str(_hierarchy(namespaced, "0::/\n"))
    elsewhere = UNIFIED.replace("/sys/fs/cgroup", "/mnt/cg")
    assert "not under /sys/fs/cgroup" in str(_hierarchy(elsewhere, "0::/\n"))
    # A container's own cgroup namespace shows its group as "/" in both files: only the
    # mounted group's type gives it away.
    contained = _hierarchy(UNIFIED, "0::/\n", lambda mount: False)
    assert "cgroup namespace" in str(contained)


def test_an_agent_sweeps_only_its_own_groups_when_another_of_its_name_shares_the_host(
    tmp_path: Path,
) -> None:
    """Two clusters' agents on one host both default to the host's name as worker id; each
    sweeps its crashed runs' groups (and nftables table) at start, and must leave the other's
    running ranks alone: the agent's key holds its work dir too. A restart of the same agent
    (same work dir) still finds what it left."""
    from muster.net.firewall import agent_key, table_name

    mine, theirs = agent_key("gpu-7", tmp_path / "a"), agent_key("gpu-7", tmp_path / "b")
    assert mine != theirs
    assert table_name(mine) != table_name(theirs)
    assert agent_key("gpu-7", tmp_path / "a" / ".." / "a") == mine  # one dir, however named
    found = Hierarchy(tmp_path, PurePosixPath("/"))
    left = tmp_path / (RankGroups(found, mine).prefix + "gabc")
    running = tmp_path / (RankGroups(found, theirs).prefix + "gabc")
    left.mkdir()
    running.mkdir()
    removed, failed = RankGroups(found, mine).sweep()  # the restarted agent
    assert (removed, failed) == ([left.name], [])
    assert running.is_dir()
