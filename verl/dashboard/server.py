"""Starting the dashboard: resolve the runs, check the port, run uvicorn until Ctrl-C."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from rich.text import Text

from verl.dashboard.app import create_app
from verl.errors import ConfigError, VerlError
from verl.tracking.follow import find_logs

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def resolve_runs(paths: list[Path]) -> list[Path]:
    """Each ``--log_dir`` -> its log(s); a directory of runs contributes all of them; duplicates dropped."""
    if not paths:
        raise ConfigError("verl dashboard needs at least one --log_dir (a run directory)")
    logs: list[Path] = []
    for path in paths:
        for log in find_logs(path):
            if log.resolve() not in {p.resolve() for p in logs}:
                logs.append(log)
    return logs


def check_port(host: str, port: int) -> None:
    if not 0 < port < 65536:
        raise ConfigError(f"--port must be between 1 and 65535, got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise VerlError(f"cannot listen on {host}:{port} ({exc.strerror}); pass another --port or stop what "
                            "uses it") from None


def serve(paths: list[Path], host: str = "127.0.0.1", port: int = 8265, refresh_seconds: float = 5.0,
          console: Any = None) -> None:
    import uvicorn

    if refresh_seconds <= 0:
        raise ConfigError(f"--refresh must be > 0 seconds, got {refresh_seconds}")
    logs = resolve_runs(paths)
    check_port(host, port)
    app = create_app(logs, refresh_seconds=refresh_seconds)
    if console is not None:
        for run in app.state.runs:
            console.print(f"run {run.name}: {run.log_path}")
        if host not in LOCAL_HOSTS:
            console.print(Text.assemble(("warning:", "yellow"), f" listening on {host}: anyone who can reach this port "
                                      "sees the logs"))
        console.print(f"dashboard: http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}  (Ctrl-C stops)")
    uvicorn.run(app, host=host, port=port, log_level="warning")
