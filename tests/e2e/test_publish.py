"""`muster publish` and a standing fleet: boxes started without --job (and --persist) wait
for a window, walk into each published run in turn, and a failed build gate publishes
nothing. Real controller, `muster join` processes, torchrun and gloo; rsync over a real sshd."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from muster.cli.local import LocalCluster
from tests.e2e.helpers import all_lines, wait_state
from tests.e2e.test_window import walk_in
from tests.sshd import sshd_or_skip

pytestmark = pytest.mark.timeout(600)

SCRIPT = """\
import sys
import torch.distributed as dist

dist.init_process_group("gloo")
print(f"rank {dist.get_rank()} of {dist.get_world_size()} ran {sys.argv[1:]}", flush=True)
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(agents=0, heartbeat_interval=1.0, heartbeat_timeout=5.0) as c:
        yield c


@pytest.fixture(autouse=True)
def boxes_leave(cluster: LocalCluster) -> Iterator[None]:
    """Every box a test walked in is stopped when it ends, passed or failed: a persistent box
    left behind would walk into the next test's window and change its world size."""
    before = dict(cluster.procs)
    yield
    for name, proc in list(cluster.procs.items()):
        if proc is not before.get(name):
            cluster.stop(name)


def source(tmp_path: Path) -> tuple[Path, Path]:
    """A training tree, and a job file that is not in it."""
    tree = tmp_path / "src"
    tree.mkdir()
    (tree / "train.py").write_text(SCRIPT)
    job = tmp_path / "job.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "name": "pub",
                "entrypoint": "train.py",
                "distributed": {"num_workers": 2, "backend": "gloo"},
            }
        )
    )
    return tree, job


def muster(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "muster", *args],
        env={
            **cluster._env(),
            "MUSTER_API_TOKEN": cluster.token(),
            "MUSTER_CONTROLLER": cluster.url,
        },
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def ran(cluster: LocalCluster, job: str) -> list[str]:
    api = cluster.client()
    done = wait_state(api, job, timeout=180)
    lines = all_lines(api, job)
    if done["state"] != "succeeded":  # every node's lines, not only the first to fail
        told = "\n".join(f"{ln['origin']} {ln['rank']}: {ln['text']}" for ln in lines)
        raise AssertionError(f"{job} {done['state']}: {done['root_cause']}\n{told}")
    return sorted(ln["text"] for ln in lines if ln["origin"] == "rank")


def test_a_persistent_fleet_walks_into_each_published_run(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    tree, job_file = source(tmp_path)
    fleet = [walk_in(cluster, None, f"fleet-{i}", "--persist") for i in range(2)]
    before = {j["id"] for j in cluster.client().jobs()}
    failed = muster(cluster, "publish", f"file://{tree}", str(job_file), "--gate", "false")
    assert failed.returncode == 2
    assert "the build gate (false) failed with exit 1; nothing was published" in failed.stderr
    assert {j["id"] for j in cluster.client().jobs()} == before

    first = muster(cluster, "publish", f"file://{tree}", str(job_file), "--", "one")
    assert first.returncode == 0, first.stderr
    run_one = first.stdout.strip()
    assert ran(cluster, run_one) == [f"rank {r} of 2 ran ['one']" for r in range(2)]

    # The next run comes from git, pinned to a commit; the same boxes walk into it.
    subprocess.run(["git", "init", "-q", str(tree)], check=True)
    subprocess.run(["git", "-C", str(tree), "add", "."], check=True)
    subprocess.run(
        ["git", "-C", str(tree), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"],
        check=True,
    )
    # A branch that is not checked out: the run is that branch's tree.
    git = ["git", "-C", str(tree), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "checkout", "-qb", "exp"], check=True)
    (tree / "train.py").write_text(SCRIPT.replace("ran {sys.argv", "ran exp {sys.argv"))
    subprocess.run([*git, "commit", "-qam", "exp"], check=True)
    subprocess.run([*git, "checkout", "-q", "-"], check=True)
    unpinned = muster(cluster, "publish", f"git+file://{tree}", str(job_file))
    assert unpinned.returncode == 2
    assert "a git source needs a ref" in unpinned.stderr
    second = muster(cluster, "publish", f"git+file://{tree}#exp", str(job_file), "--", "two")
    assert second.returncode == 0, second.stderr
    run_two = second.stdout.strip()
    assert run_two != run_one
    assert ran(cluster, run_two) == [f"rank {r} of 2 ran exp ['two']" for r in range(2)]
    members = {m["worker"] for m in cluster.client().job(run_two)["members"]}
    assert members == {"walkin-fleet-0", "walkin-fleet-1"}
    for i, box in enumerate(fleet):
        assert box.poll() is None  # a persistent fleet stays for the next run
        cluster.stop(f"join-fleet-{i}")


def test_an_rsync_source_comes_over_ssh(
    cluster: LocalCluster, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    server = sshd_or_skip(tmp_path_factory.mktemp("sshd"), cluster.port, guarded=False)
    try:
        tree, job_file = source(tmp_path)
        (tree / "uncommitted.txt").write_text("work in progress\n")
        (tree / "elsewhere").symlink_to("/etc")  # never shipped, never under the gate
        box = walk_in(cluster, None, "rsync-box", "--procs", "2")
        options = [f"IdentityFile={server.key}", *server.client_options]
        done = muster(
            cluster,
            "publish",
            f"rsync://root@127.0.0.1:{server.port}:{tree}",
            str(job_file),
            *(arg for option in options for arg in ("--ssh-option", option)),
            "--",
            "synced",
        )
        assert done.returncode == 0, done.stderr
        assert "(rsync)" in done.stderr
        assert "symbolic links are not shipped; left out: elsewhere" in done.stderr
        run = done.stdout.strip()
        # One box of 2 ranks fills the 2-rank window.
        assert ran(cluster, run) == [f"rank {r} of 2 ran ['synced']" for r in range(2)]
        assert box.wait(60) == 0
    finally:
        server.stop()


SSHFS_SCRIPT = """\
import os
import torch.distributed as dist

dist.init_process_group("gloo")
data = os.environ["MUSTER_DATA_PATH"]
try:
    open(os.path.join(data, "mine.txt"), "w").close()
    wrote = "wrote"
except OSError:
    wrote = "read-only"
seen = open(os.path.join(data, "shard.txt")).read().strip()
print(f"rank {dist.get_rank()} sees {seen} ({wrote})", flush=True)
dist.destroy_process_group()
"""


def test_a_data_source_is_mounted_read_only_over_sshfs_for_the_ranks(
    cluster: LocalCluster, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    if shutil.which("sshfs") is None or not os.path.exists("/dev/fuse"):
        if os.environ.get("MUSTER_TEST_REQUIRE_SSH") == "1":
            pytest.fail("sshfs and /dev/fuse are required here (.ci/run installs sshfs)")
        pytest.skip("no sshfs or no /dev/fuse on this machine")
    server = sshd_or_skip(tmp_path_factory.mktemp("sshd"), cluster.port, guarded=False)
    mount = tmp_path / "mnt"
    try:
        served = tmp_path / "served"
        served.mkdir()
        (served / "shard.txt").write_text("shard-0\n")
        job_dir = tmp_path / "job"
        job_dir.mkdir()
        (job_dir / "train.py").write_text(SSHFS_SCRIPT)
        spec = {
            "name": "sshfs",
            "entrypoint": "train.py",
            "distributed": {"num_workers": 1, "procs_per_worker": 2, "backend": "gloo"},
        }
        (job_dir / "job.yaml").write_text(yaml.safe_dump(spec))
        box = walk_in(
            cluster,
            None,
            "mounted",
            "--procs",
            "2",
            "--data-source",
            f"sshfs://root@127.0.0.1:{server.port}:{served}",
            "--data-path",
            str(mount),
            "--ssh-identity",
            str(server.key),
            *(arg for option in server.client_options for arg in ("--ssh-option", option)),
        )
        done = muster(cluster, "publish", f"file://{job_dir}", str(job_dir / "job.yaml"))
        assert done.returncode == 0, done.stderr
        assert ran(cluster, done.stdout.strip()) == [
            f"rank {r} sees shard-0 (read-only)" for r in range(2)
        ]
        assert box.wait(60) == 0
        assert not os.path.ismount(mount)  # taken down when the box left
        assert not (served / "mine.txt").exists()
    finally:
        subprocess.run(["fusermount", "-u", "-z", str(mount)], capture_output=True, check=False)
        server.stop()


def test_the_guarded_source_key_serves_the_tree_to_rsync_read_only_and_nothing_else(
    cluster: LocalCluster, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The guarded recipe's second key: `command="rrsync -ro <served>",restrict`. A publish
    asks for `/` (re-rooted at the served tree); a shell, or a write, is refused."""
    if shutil.which("rrsync") is None:
        if os.environ.get("MUSTER_TEST_REQUIRE_SSH") == "1":
            pytest.fail("rrsync is required here (Debian's rsync package ships it)")
        pytest.skip("no rrsync on this machine")
    tree, job_file = source(tmp_path)
    server = sshd_or_skip(tmp_path_factory.mktemp("sshd"), cluster.port, guarded=True, served=tree)
    try:
        assert server.source_key is not None
        options = [f"IdentityFile={server.source_key}", *server.client_options]
        box = walk_in(cluster, None, "guarded-box", "--procs", "2")
        done = muster(
            cluster,
            "publish",
            f"rsync://root@127.0.0.1:{server.port}:/",
            str(job_file),
            *(arg for option in options for arg in ("--ssh-option", option)),
            "--",
            "guarded",
        )
        assert done.returncode == 0, done.stderr
        assert ran(cluster, done.stdout.strip()) == [
            f"rank {r} of 2 ran ['guarded']" for r in range(2)
        ]
        assert box.wait(60) == 0
        ssh = ["ssh", "-o", "BatchMode=yes", "-p", str(server.port)]
        ssh += [arg for option in options for arg in ("-o", option)]
        shell = subprocess.run(
            [*ssh, "root@127.0.0.1", "echo", "escaped"], capture_output=True, text=True, timeout=30
        )
        assert "escaped" not in shell.stdout
        planted = tmp_path / "planted.txt"
        planted.write_text("x")
        push = subprocess.run(
            ["rsync", "-e", " ".join(ssh), str(planted), "root@127.0.0.1:/"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert push.returncode != 0
        assert not (tree / "planted.txt").exists()
    finally:
        server.stop()
