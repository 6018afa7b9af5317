"""``verl dashboard``: serve the live dashboard for one or more runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from verl.utils.cli import new_console, run_guarded


def dashboard_command(
    ctx: typer.Context,
    log_dir: Annotated[list[Path], typer.Option(
        "--log_dir", "--log-dir",
        help="Run directory (or a directory of runs, or a verl_logs.jsonl); more runs may follow: --log_dir A B.")],
    port: Annotated[int, typer.Option("--port", help="TCP port.")] = 8265,
    host: Annotated[str, typer.Option("--host", help="Interface to bind; 0.0.0.0 exposes the logs to the network.")
                    ] = "127.0.0.1",
    refresh: Annotated[float, typer.Option("--refresh", help="Seconds between browser refreshes.")] = 5.0,
) -> None:
    """Live dashboard: reward, KL, losses, length, throughput, eval accuracy; runs overlaid; latest samples."""

    def _run() -> None:

        from verl.dashboard.server import serve
        from verl.errors import VerlError

        extra = [a for a in ctx.args if a.startswith("-")]
        if extra:
            raise VerlError(f"unexpected option(s) {extra}; usage: verl dashboard --log_dir RUN [RUN2 ...] "
                            "[--port 8265] [--host 127.0.0.1] [--refresh 5]")
        paths = [*log_dir, *(Path(a) for a in ctx.args)]
        serve(paths, host=host, port=port, refresh_seconds=refresh, console=new_console())

    run_guarded(_run)


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the ``verl`` app."""
    app.command("dashboard", context_settings={"allow_extra_args": True})(dashboard_command)
