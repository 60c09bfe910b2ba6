"""The ``muster`` command: one typer app, one module per verb."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from collections.abc import Callable
from functools import wraps
from typing import ParamSpec, TypeVar

import typer
from rich.console import Console

from muster.errors import MusterError, SpecError

app = typer.Typer(
    name="muster",
    help="Run one PyTorch training job across many machines as a gang.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    # A callback keeps the app a group of verbs when only one verb's module is imported
    # (typer runs a lone command as the program itself).
    pass


out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

P = ParamSpec("P")
R = TypeVar("R")


def reports_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn a MusterError into its message on stderr and its exit code (2 for bad input)."""

    @wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except SpecError as exc:
            err.print(f"[red]error:[/] {exc.source} is invalid:", markup=True)
            for e in exc.errors:
                err.print(f"  {e}", markup=False)
            raise typer.Exit(exc.exit_code) from None
        except MusterError as exc:
            err.print("[red]error:[/] ", end="", markup=True)
            err.print(str(exc), markup=False)
            raise typer.Exit(exc.exit_code) from None

    return wrapper


def main() -> None:
    """Import the verb's own module only (a client verb starts in a third of the time the
    whole command line takes to import: the store, the agent, the server); anything else,
    help or a verb this map does not know, loads them all."""
    verb = sys.argv[1] if len(sys.argv) > 1 else None
    if verb in VERBS:
        importlib.import_module(f"muster.cli.{VERBS[verb]}")
    else:
        load_commands()
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


# Which module registers each verb (tests/cli check it against load_commands(); a verb
# missing here still works, through load_commands, only slower).
VERBS = {
    "agent": "agent",
    "join": "agent",
    "artifacts": "artifacts",
    "demo": "demo",
    "gc": "gc",
    "submit": "jobs",
    "get": "jobs",
    "describe": "jobs",
    "cancel": "jobs",
    "k8s": "k8s",
    "logs": "logs",
    "plan": "plan",
    "publish": "publish",
    "relay": "relay",
    "server": "server",
    "stacks": "stacks",
    "token": "token",
    "up": "up",
    "usage": "usage",
    "validate": "validate",
    "verify-fabric": "verify",
    "status": "window",
    "start": "window",
}


def load_commands() -> typer.Typer:
    """The app with every verb registered (each module adds its own when imported)."""
    import muster.cli

    for module in pkgutil.iter_modules(muster.cli.__path__):
        importlib.import_module(f"muster.cli.{module.name}")
    return app
