"""Loopback networking helpers shared by the dashboard, the load test, benchmarks and tests."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A free TCP port on the loopback interface (the OS picks it; free when checked, so bind it soon — or use
    ``reserved_port`` when the server that binds it starts seconds later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def reserve_port(host: str = LOOPBACK) -> socket.socket:
    """A socket bound to a port the OS picked, with ``SO_REUSEADDR`` and never listening: its port is the
    reservation (``.getsockname()[1]``), released by closing it.

    While it is open, Linux hands the port to no other socket — not as an outgoing connection's source port, not
    to another ``bind(0)`` — yet a server that binds it explicitly with ``SO_REUSEADDR`` (uvicorn and every asyncio
    server, gRPC, ZeroMQ) can. A port from ``free_port()`` is unguarded from the check until the server binds it: a
    server process that imports torch first leaves seconds in which a busy machine's other connections can take
    it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
    except OSError:
        sock.close()
        raise
    return sock


@contextlib.contextmanager
def reserved_port(host: str = LOOPBACK) -> Iterator[int]:
    """``reserve_port`` for a block: the port is held until the block ends (start the server inside it)."""
    sock = reserve_port(host)
    try:
        yield int(sock.getsockname()[1])
    finally:
        sock.close()


@contextlib.contextmanager
def running_app(app: Any, port: int | None = None, timeout: float = 30.0, name: str = "server"
                ) -> Iterator[str]:
    """Serve the ASGI ``app`` with uvicorn in a background thread on the loopback interface; yields its base URL
    once it listens, stops it on exit. ``timeout`` bounds both the start-up and the stop."""
    import threading  # noqa: PLC0415
    import time  # noqa: PLC0415

    import uvicorn  # noqa: PLC0415

    from verl.errors import VerlError  # noqa: PLC0415

    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host=LOOPBACK, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name=f"verl-{name}", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise VerlError(f"the {name} did not start on {LOOPBACK}:{port}")
        time.sleep(0.05)
    try:
        yield f"http://{LOOPBACK}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)
