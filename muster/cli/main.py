"""The ``muster`` command: one typer app, one module per verb."""

from __future__ import annotations

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
    load_commands()
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


def load_commands() -> typer.Typer:
    """The app with every verb registered (each module adds its own when imported)."""
    from muster.cli import (  # noqa: F401  (each module registers its verbs)
        agent,
        artifacts,
        demo,
        gc,
        jobs,
        k8s,
        logs,
        plan,
        publish,
        relay,
        server,
        stacks,
        token,
        up,
        usage,
        validate,
        verify,
        window,
    )

    return app
