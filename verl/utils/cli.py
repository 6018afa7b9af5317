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

from verl.errors import ConfigError, VerlError

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


def option(default: Any = dataclasses.MISSING, *flags: str, help: str = "", parse: Callable[[Any], Any] | None = None,
           cli_type: Any = None, cli_default: Any = dataclasses.MISSING, argument: bool = False,
           **typer_kwargs: Any) -> Any:
    """A settings field that is also its command's option: one declaration, one default (none: required).
    ``flags`` and ``typer_kwargs`` as typer's (``argument``: a positional argument); ``cli_type``, ``cli_default`` and
    ``parse`` when the command line's value has another type than the field's (``parse`` turns one into the other);
    a list default is copied per instance."""
    info = typer.Argument(help=help, **typer_kwargs) if argument else typer.Option(*flags, help=help, **typer_kwargs)
    meta = {"option": info, "flags": flags, "parse": parse, "cli_type": cli_type, "cli_default": cli_default}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def nested(settings: type) -> Any:
    """A settings field holding another settings dataclass whose options join the command's."""
    return dataclasses.field(default_factory=settings, metadata={"nested": settings})


def parameter(name: str, kind: Any, info: Any, default: Any = inspect.Parameter.empty) -> inspect.Parameter:
    """A typer parameter ``name: Annotated[kind, info] = default`` (no default: required)."""
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[kind, info])


def _options(settings: type) -> list[inspect.Parameter]:
    """One typer parameter per ``option`` field of ``settings`` and of its ``nested`` settings, in field order."""
    hints, found = typing.get_type_hints(settings), []
    for f in dataclasses.fields(settings):
        if "nested" in f.metadata:
            found += _options(f.metadata["nested"])
        elif "option" in f.metadata:
            meta = f.metadata
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            default = meta["cli_default"] if meta["cli_default"] is not dataclasses.MISSING else default
            found.append(parameter(f.name, meta["cli_type"] or hints[f.name], meta["option"],
                                   inspect.Parameter.empty if default is dataclasses.MISSING else default))
    return found


def build_settings(settings: type, values: dict[str, Any]) -> Any:
    """``settings`` from a command's ``values`` (each option's ``parse`` applied; nested settings built first). A
    settings class's ValueError is the user's input: a ConfigError."""
    kwargs = {}
    for f in dataclasses.fields(settings):
        if "nested" in f.metadata:
            kwargs[f.name] = build_settings(f.metadata["nested"], values)
        elif "option" in f.metadata:
            parse, value = f.metadata["parse"], values[f.name]
            kwargs[f.name] = parse(value) if parse and value is not None else value
    try:
        return settings(**kwargs)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def command(run: Callable[..., Any], settings: type, *leading: inspect.Parameter) -> Callable[..., Any]:
    """A typer command: the ``leading`` parameters, then one option per ``option`` field of ``settings``. It calls
    ``run(**leading values, settings=build_settings(...))`` under ``run_guarded``; ``run``'s docstring is its
    help."""
    names = {p.name for p in leading}

    def invoke(**values: Any) -> Any:
        return run_guarded(lambda: run(**{k: values[k] for k in names}, settings=build_settings(settings, values)))

    invoke.__signature__ = inspect.Signature([*leading, *_options(settings)])
    invoke.__doc__, invoke.__name__ = run.__doc__, run.__name__
    return invoke


def key_values(items: list[str] | None, flag: str, parsers: dict[str, Callable[[str], Any]], tool: str,
               example: str) -> dict[str, Any]:
    """``--FLAG KEY=VALUE`` options passed on to another tool (lm-eval, Inspect): each key one ``parsers`` knows,
    each value parsed as that tool's CLI parses it; anything else refused by name, in one line."""
    values: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep:
            raise ConfigError(f"{flag} {item!r}: expected KEY=VALUE (e.g. {example})")
        if key not in parsers:
            raise ConfigError(f"{flag} {key}: not an {tool} option verl eval passes on; known: {', '.join(parsers)}")
        try:
            values[key] = parsers[key](value)
        except ValueError as exc:
            raise ConfigError(f"{flag} {key}={value}: {exc}") from None
    return values
