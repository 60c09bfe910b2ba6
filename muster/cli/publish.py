"""``muster publish SRC JOB.yaml [-- ARGS]``: a new run for the boxes waiting to walk in.

The source is fetched into a fresh tree (``file:///abs/dir``; ``rsync://[user@]host[:port]:
/abs/dir`` over ssh, which carries uncommitted work; ``git+https://...#ref``,
``git+ssh://...#ref`` or ``git+file://...#ref``, pinned: a ref is required), the build gate
runs once in it (``--gate``, default: byte-compile every Python file), and only then is the
job submitted as a window job with that tree as its bundle and ``ARGS`` as its arguments.
The submission is the commit point: a box that dials while a publish is under way finds no
new window and waits; a gate that fails publishes nothing. Each publish is a new job (its id
is the run's identity), so boxes holding different runs never meet in one world; walk-ins
started without ``--job`` (and ``--persist``) join the newest run on their next dial.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import typer

from muster.cli.common import ControllerOpt, TokenFileOpt, client
from muster.cli.main import app, err, out, reports_errors
from muster.errors import UserError
from muster.spec import JobSpec, load_job_file, parse_job
from muster.spec.cluster import ssh_option_problem

FETCH_TIMEOUT_S = 600
_RSYNC = re.compile(
    r"^rsync://(?:(?P<user>[^-@/\s][^@/\s]*)@)?(?P<host>[^-:/\s][^:/\s]*)(?::(?P<port>\d+))?"
    r":(?P<path>/\S*)$"
)


def fetch(source: str, into: Path, ssh_options: list[str] | None = None) -> str:
    """Fetch ``source`` into the empty directory ``into``; returns what it was, in words."""
    if source.startswith("file://"):
        path = Path(source.removeprefix("file://"))
        if not path.is_absolute() or not path.is_dir():
            raise UserError(f"{source}: file:// takes an absolute path to a directory")
        shutil.copytree(path, into, dirs_exist_ok=True, symlinks=True)
        return f"the directory {path}"
    if source.startswith("rsync://"):
        found = _RSYNC.match(source)
        if found is None:
            raise UserError(f"{source}: write rsync://[user@]host[:port]:/absolute/path")
        ssh = shlex.join(
            [
                "ssh",
                *("-o", "BatchMode=yes"),
                *(("-p", found["port"]) if found["port"] else ()),
                *(arg for option in ssh_options or [] for arg in ("-o", option)),
            ]
        )
        remote = f"{found['user']}@{found['host']}" if found["user"] else found["host"]
        where = f"{remote}:{found['path'].rstrip('/')}/"
        # rsync >= 3.2.4 escapes the remote path for the remote shell itself (--protect-args
        # would be refused by a guarded key's rrsync); the path holds no whitespace anyway.
        _run(["rsync", "-a", "-e", ssh, "--", where, f"{into}/"], source)
        return f"{found['path']} on {found['host']} (rsync)"
    if source.startswith("git+"):
        url, _, ref = source.removeprefix("git+").partition("#")
        if not ref:
            raise UserError(
                f"{source}: a git source needs a ref (#<commit, tag or branch>): a default "
                "branch moves, and a run must be pinned"
            )
        _run(["git", "clone", "--quiet", "--no-checkout", "--", url, str(into)], source)
        known = subprocess.run(  # a commit or a tag, else a branch of the remote
            ["git", "-C", str(into), "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
            capture_output=True,
            text=True,
            check=False,
        )
        target = ref if known.returncode == 0 else f"origin/{ref}"
        _run(["git", "-C", str(into), "checkout", "--quiet", "--detach", target, "--"], source)
        commit = _run(["git", "-C", str(into), "rev-parse", "HEAD"], source).strip()
        shutil.rmtree(into / ".git", ignore_errors=True)
        return f"{url} at {ref} ({commit[:12]})"
    raise UserError(
        f"{source}: unknown source; use file:///abs/dir, rsync://[user@]host[:port]:/abs/dir "
        "or git+https://host/repo#ref"
    )


def drop_links(tree: Path) -> list[str]:
    """Remove every symbolic link from the fetched tree: a bundle ships none, so the gate
    must not pass on (or write through) what would not be shipped. Returns what went."""
    gone = []
    for path in sorted(tree.rglob("*")):
        if path.is_symlink():
            gone.append(path.relative_to(tree).as_posix())
            path.unlink()
    return gone


def _run(argv: list[str], source: str) -> str:
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"{source}: {argv[0]} failed: {exc}") from exc
    if done.returncode != 0:
        said = " ".join(done.stderr.split())[-400:]
        raise UserError(f"{source}: {argv[0]} exited {done.returncode}: {said}")
    return done.stdout


def gate(tree: Path, command: str | None) -> None:
    """The build gate, once, in the fetched tree: the run is published only if it passes."""
    argv = shlex.split(command) if command else [sys.executable, "-m", "compileall", "-q", "."]
    try:
        done = subprocess.run(
            argv, cwd=tree, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"the build gate ({shlex.join(argv)}) could not run: {exc}") from exc
    if done.returncode != 0:
        said = (done.stdout + done.stderr).strip().splitlines()[-15:]
        raise UserError(
            f"the build gate ({shlex.join(argv)}) failed with exit {done.returncode}; nothing "
            "was published. Its last lines:\n" + "\n".join(f"  {line}" for line in said)
        )
    for cache in tree.rglob("__pycache__"):  # the gate's byproducts are not the run's
        shutil.rmtree(cache, ignore_errors=True)


def run_spec(spec: JobSpec, args: list[str] | None) -> JobSpec:
    """The job as the run to publish: a window job, with the publish's arguments if given."""
    data: dict[str, Any] = spec.model_dump(mode="json", exclude_none=True)
    dist = data.get("distributed") or {"num_workers": 1}
    dist["membership"] = "window"
    data["distributed"] = dist
    if args is not None:
        data["args"] = args
    data["workdir"] = "."
    return parse_job(data, source="the published run")


@app.command(context_settings={"allow_extra_args": True})
@reports_errors
def publish(
    ctx: typer.Context,
    source: str = typer.Argument(..., help="file:///dir, rsync://[user@]host:/dir, git+URL#ref"),
    job_file: Path = typer.Argument(..., help="the job (its workdir is replaced by SOURCE)"),
    gate_command: str = typer.Option(
        None, "--gate", help="the build gate, run once in the fetched tree [compile the Python]"
    ),
    ssh_option: list[str] = typer.Option(
        [], "--ssh-option", help="an ssh -o option for an rsync:// source (repeatable)"
    ),
    controller: str = ControllerOpt,
    token_file: Path | None = TokenFileOpt,
) -> None:
    """Publish a run: fetch SOURCE, pass the build gate, then submit JOB as a window job
    with that tree (arguments after -- replace the job's args)."""
    for option in ssh_option:
        problem = ssh_option_problem(option)
        if problem:
            raise UserError(f"--ssh-option: {problem}")
    spec = load_job_file(job_file)
    args = list(ctx.args) if ctx.args else None
    world = run_spec(spec, args)
    api = client(controller, token_file)
    with tempfile.TemporaryDirectory(prefix="muster-publish-") as tmp:
        tree = Path(tmp) / "tree"
        what = fetch(source, tree, ssh_option)
        dropped = drop_links(tree)
        if dropped:
            shown = ", ".join(dropped[:5]) + (
                f" and {len(dropped) - 5} more" if len(dropped) > 5 else ""
            )
            err.print(f"warning: symbolic links are not shipped; left out: {shown}", markup=False)
        gate(tree, gate_command)
        job = api.submit_with_bundle(world, tree)["id"]
    err.print(f"published {job}: {what}; walk-ins without --job join it", markup=False)
    out.print(job, markup=False)
