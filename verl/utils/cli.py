"""What every ``verl`` command shares: one-line errors (``run_guarded``) and the ``--debug`` switch.

Here, at the bottom, so each feature's commands (``eval.cli``, ``serve.cli``, ...) are plain module-level functions
that import it, and ``verl.cli`` (the face) only attaches them.
"""

from __future__ import annotations

from typing import Any

import typer
from rich.console import Console

from verl.errors import VerlError

err = Console(stderr=True, highlight=False)
STATE = {"debug": False}  # set by `verl --debug` (or VERL_DEBUG=1)


def run_guarded(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn``; print a ``VerlError`` as one line (traceback only with --debug) and exit 1."""
    try:
        return fn(*args, **kwargs)
    except VerlError as exc:
        if STATE["debug"]:
            raise
        err.print(f"[bold red]error:[/] {exc}", soft_wrap=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        err.print("interrupted")
        raise typer.Exit(130) from None
