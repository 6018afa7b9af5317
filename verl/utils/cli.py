"""What every ``verl`` command shares: one-line errors (``run_guarded``), the ``--debug`` switch, the console
(verbatim, no markup) and dotted overrides.

Here, at the bottom, so every package's commands are plain module-level functions that import it, and ``verl.cli``
only attaches them.
"""

from __future__ import annotations

import os
from typing import Any

import typer
from rich.console import Console
from rich.text import Text

from verl.errors import VerlError

STATE = {"debug": os.environ.get("VERL_DEBUG") == "1"}  # or `verl --debug`
# Extra CLI args are dotted overrides: `verl train actor.optim.lr=1e-5 --trainer.total_steps=10`.
OVERRIDE_CONTEXT = {"allow_extra_args": True, "ignore_unknown_options": True}


def new_console(stderr: bool = True) -> Console:
    """The console every command prints through: no markup, so a message prints verbatim (``pip install
    'verl-suite[real-model]'`` keeps its brackets); styled parts are ``rich.text.Text`` spans."""
    return Console(stderr=stderr, highlight=False, markup=False)


err = new_console()


def split_overrides(extra: list[str]) -> list[str]:
    """The extra arguments of a command, each ``key=value``; anything else is refused by name."""
    bad = [a for a in extra if "=" not in a]
    if bad:
        raise VerlError(f"unexpected argument(s) {bad}; overrides look like key=value, e.g. trainer.total_steps=10")
    return extra


def command_group(app: typer.Typer, name: str) -> typer.Typer:
    """The sub-app ``verl NAME`` of ``app`` (a package adds its commands to the core's ``verl data`` group)."""
    return next(group.typer_instance for group in app.registered_groups if group.name == name)


def run_guarded(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn``; print a ``VerlError`` as one line (traceback only with --debug) and exit 1."""
    try:
        return fn(*args, **kwargs)
    except VerlError as exc:
        if STATE["debug"]:
            raise
        err.print(Text.assemble(("error:", "bold red"), f" {exc}"), soft_wrap=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        err.print("interrupted")
        raise typer.Exit(130) from None
