"""What every ``verl`` command shares: one-line errors (``run_guarded``), the ``--debug`` switch, the console
(verbatim, no markup) and dotted overrides.

Here, at the bottom, so every package's commands are plain module-level functions that import it, and ``verl.cli``
only attaches them.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import typing
from collections.abc import Callable
from typing import Annotated, Any

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



def option(default: Any = None, *flags: str, help: str = "", parse: Callable[[Any], Any] | None = None,
           cli_type: Any = None, **typer_kwargs: Any) -> Any:
    """A settings field that is also its command's option: one declaration, one default. ``flags`` and
    ``typer_kwargs`` as typer's; ``cli_type`` and ``parse`` when the command line's value has another type than the
    field's (``parse`` turns one into the other); a list default is copied per instance."""
    meta = {"option": typer.Option(*flags, help=help, **typer_kwargs), "flags": flags, "parse": parse,
            "cli_type": cli_type}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def parameter(name: str, kind: Any, info: Any, default: Any = inspect.Parameter.empty) -> inspect.Parameter:
    """A typer parameter ``name: Annotated[kind, info] = default`` (no default: required)."""
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[kind, info])


def command(run: Callable[..., Any], settings: type, *leading: inspect.Parameter) -> Callable[..., Any]:
    """A typer command: the ``leading`` parameters, then one option per ``option`` field of ``settings``. It calls
    ``run(**leading values, settings=settings(**fields, each option's parse applied))`` under ``run_guarded``;
    ``run``'s docstring is its help."""
    hints, fields = typing.get_type_hints(settings), [f for f in dataclasses.fields(settings) if "option" in f.metadata]
    names = {p.name for p in leading}

    def invoke(**values: Any) -> Any:
        parsed = {f.name: f.metadata["parse"](values[f.name]) if f.metadata["parse"] and values[f.name] is not None
                  else values[f.name] for f in fields}
        return run_guarded(lambda: run(**{k: values[k] for k in names}, settings=settings(**parsed)))

    options = [parameter(f.name, f.metadata["cli_type"] or hints[f.name], f.metadata["option"],
                         f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
               for f in fields]
    invoke.__signature__ = inspect.Signature([*leading, *options])
    invoke.__doc__, invoke.__name__ = run.__doc__, run.__name__
    return invoke
