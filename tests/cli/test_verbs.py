"""`muster VERB` imports the verb's own module only: a client verb starts in a third of the
time, and the map from verb to module stays the one the modules register."""

from __future__ import annotations

import subprocess
import sys

import typer.core
import typer.main

from muster.cli.main import VERBS, load_commands

HEAVY = ("muster.store", "muster.agent.agent", "muster.controller.app", "fastapi")


def script(*argv: str) -> str:
    """``muster ARGV`` through main(), then which heavy modules it imported."""
    return (
        "import sys\n"
        f"sys.argv = ['muster', *{list(argv)!r}]\n"
        "from muster.cli.main import main\n"
        "try:\n"
        "    main()\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print('IMPORTED', sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script(*argv)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_map_names_every_verb_the_command_line_has() -> None:
    # (every module of muster.cli imported: a new module's verbs count too)
    group = typer.main.get_command(load_commands())
    assert isinstance(group, typer.core.TyperGroup)
    assert set(VERBS) == set(group.commands)


def test_every_verb_runs_with_only_its_own_module_imported() -> None:
    procs = {
        verb: subprocess.Popen(
            [sys.executable, "-c", script(verb, "--help")],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for verb in VERBS
    }
    for verb, proc in procs.items():
        out, _ = proc.communicate(timeout=120)
        assert f"Usage: muster {verb} [OPTIONS]" in out, out


def test_a_client_verb_loads_neither_the_store_nor_the_agent_nor_the_server() -> None:
    done = run("get", "--help")
    assert "Usage: muster get" in done.stdout, done.stderr
    assert "IMPORTED []" in done.stdout


def test_a_verb_whose_module_registers_it_alone_is_still_a_verb() -> None:
    # (typer runs a lone command as the program itself unless the app has a callback)
    done = run("plan", "--help")
    assert "Usage: muster plan [OPTIONS] {job_file}" in done.stdout, done.stdout + done.stderr


def test_help_and_unknown_verbs_load_every_verb() -> None:
    assert "verify-fabric" in run("--help").stdout
    done = run("bogus")
    assert "No such command 'bogus'" in done.stdout + done.stderr
