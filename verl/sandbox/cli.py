"""``verl sandbox serve`` (SandboxFusion's ``/run_code`` on our sandbox) and ``verl sandbox run FILE``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from verl.utils.cli import err, run_guarded

sandbox_app = typer.Typer(help="The code sandbox: run untrusted programs isolated (docs/sandbox.md).",
                          no_args_is_help=True)

Timeout = Annotated[float, typer.Option("--run-timeout", help="Default wall-clock seconds per run (a request's "
                                        "run_timeout overrides it); CPU seconds are capped alike.")]
Memory = Annotated[int, typer.Option("--memory-limit-mb", help="Default address-space limit per run, MB.")]


def _sandbox(run_timeout: float, memory_limit_mb: int, max_concurrent: int, processes: int, output_bytes: int,
             require_isolation: bool):
    import math

    from verl.sandbox import Limits, Sandbox

    limits = Limits(wall_seconds=run_timeout, cpu_seconds=math.ceil(run_timeout), memory_mb=memory_limit_mb,
                    processes=processes, output_bytes=output_bytes)
    return Sandbox(limits, max_concurrent=max_concurrent, require_isolation=require_isolation)


@sandbox_app.command("serve")
def serve(
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.")] = 8080,
    max_concurrent: Annotated[int, typer.Option(help="Programs run at once; more requests wait.")] = 4,
    run_timeout: Timeout = 10.0,
    memory_limit_mb: Memory = 1024,
    processes: Annotated[int, typer.Option(help="Processes (and threads) per run.")] = 64,
    output_bytes: Annotated[int, typer.Option(help="stdout and stderr are each cut at this many bytes.")] = 1 << 20,
    require_isolation: Annotated[bool, typer.Option(
        "--require-isolation/--allow-weak", help="Refuse to start without bubblewrap (default), or run with "
        "resource limits only after a warning.")] = True,
) -> None:
    """Serve the sandbox with SandboxFusion's API: POST /run_code, GET /health."""

    def _run():
        import uvicorn

        from verl.sandbox.server import build_app

        sandbox = _sandbox(run_timeout, memory_limit_mb, max_concurrent, processes, output_bytes, require_isolation)
        err.print(f"sandbox ({sandbox.mechanism}) on http://{host}:{port}/run_code, {max_concurrent} at once",
                  soft_wrap=True)
        uvicorn.run(build_app(sandbox), host=host, port=port, log_level="warning")

    run_guarded(_run)


@sandbox_app.command("run")
def run(
    file: Annotated[Path, typer.Argument(help="A Python file to run in the sandbox.", exists=True, dir_okay=False)],
    stdin: Annotated[Path | None, typer.Option(help="A file given to the program as its stdin.")] = None,
    run_timeout: Timeout = 10.0,
    memory_limit_mb: Memory = 1024,
) -> None:
    """Run one Python file in the sandbox and print SandboxFusion's response as JSON."""

    def _run() -> int:
        from verl.sandbox import RunCodeRequest

        sandbox = _sandbox(run_timeout, memory_limit_mb, 1, 64, 1 << 20, require_isolation=False)
        response = sandbox.run(RunCodeRequest(code=file.read_text(), stdin=stdin.read_text() if stdin else None))
        print(response.model_dump_json(indent=2))
        return 0 if response.status == "Success" else 1

    raise typer.Exit(run_guarded(_run))


def register(app: typer.Typer) -> None:
    app.add_typer(sandbox_app, name="sandbox")
