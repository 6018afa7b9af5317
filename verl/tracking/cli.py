"""``verl tensorboard``: the JSONL -> TensorBoard converter command (see ``verl.tracking.converter``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from verl.utils.cli import err, run_guarded


def tensorboard_command(
    log_dir: Annotated[Path, typer.Option("--log_dir", "--log-dir",
                                          help="Run directory (or --log_dir of `verl train`, or a .jsonl file).")],
    tb_dir: Annotated[Path | None, typer.Option("--tb_dir", "--tb-dir",
                                                help="Where event files go (default: <log_dir>/tb).")] = None,
    interval: Annotated[float, typer.Option("--interval", help="Seconds between scans of the log.")] = 30.0,
    once: Annotated[bool, typer.Option("--once", help="Convert what is there and exit (no following).")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress lines.")] = False,
) -> None:
    """Convert verl_logs.jsonl to TensorBoard event files, following the log while training runs (Ctrl-C stops).

    Then: tensorboard --logdir TB_DIR
    """

    def _run() -> None:
        from verl.tracking.converter import follow
        from verl.tracking.follow import resolve_log_path

        # A run directory without its log yet is fine when following (the trainer is starting up).
        log_path = resolve_log_path(log_dir, must_exist=once or not log_dir.exists())
        target = tb_dir or (log_path.parent / "tb")
        report = None if quiet else (lambda line: err.print(line, soft_wrap=True))
        if not quiet:
            mode = "" if once else f" every {interval:g}s (Ctrl-C stops)"
            err.print(f"converting {log_path} -> {target}{mode}")
        converter = follow(log_path, target, interval=interval, once=once, report=report)
        if not quiet:
            totals = ", ".join(f"{n} {k}" for k, n in sorted(converter.counts.items())) or "nothing yet"
            err.print(f"stopped; {target} holds {totals}. View: tensorboard --logdir {target}")

    run_guarded(_run)


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the ``verl`` app."""
    app.command("tensorboard")(tensorboard_command)
