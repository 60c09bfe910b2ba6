"""`muster VERB` imports the verb's own module only: a client verb starts in a third of the
time, and the map from verb to module stays the one the modules register."""

from __future__ import annotations

import subprocess
import sys

from muster.cli.main import VERBS, load_commands


def registered() -> dict[str, str]:
    """Every top-level verb of the whole command line, and the module that registers it."""
    app = load_commands()
    verbs = {
        command.name or command.callback.__name__: command.callback.__module__
        for command in app.registered_commands
        if command.callback is not None
    }
    for group in app.registered_groups:
        sub = group.typer_instance
        assert sub is not None
        name = sub.info.name
        assert isinstance(name, str), "a sub-app registers under its own name"
        module = next(c.callback.__module__ for c in sub.registered_commands if c.callback)
        verbs[name] = module
    return verbs


def test_the_map_names_every_verb_and_the_module_that_registers_it() -> None:
    assert {verb: f"muster.cli.{module}" for verb, module in VERBS.items()} == registered()


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys\n"
        f"sys.argv = ['muster', *{list(argv)!r}]\n"
        "from muster.cli.main import main\n"
        "try:\n"
        "    main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = ('muster.store', 'muster.agent.agent', 'muster.controller.app', 'fastapi')\n"
        "print('IMPORTED', sorted(m for m in heavy if m in sys.modules))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )


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
