"""Ports for the servers the tests start, reserved for the rest of the test process.

``verl.utils.net.free_port`` releases its port when it returns; a server process that imports torch before it
binds leaves seconds in which, on a box running other tests' load beside it, any outgoing connection can take that
port as its source port. Here the port stays bound (``reserve_port``: ``SO_REUSEADDR``, never listening) until the
process exits, so only the server the test starts, binding it explicitly, can use it — and an address nobody
serves (a "down" upstream) stays down."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx

from tests.conftest import REPO
from verl.utils.net import reserve_port

_HELD: list[socket.socket] = []  # open until the test process exits: the reservations


def free_port() -> int:
    sock = reserve_port()
    _HELD.append(sock)
    return int(sock.getsockname()[1])


def serve(*command: str, health: str = "/health") -> tuple[subprocess.Popen, str]:
    """Start ``python COMMAND --port P`` in the repository and wait (up to 120 s) for ``GET health`` to answer 200:
    the process and its base URL. The server's output is in ``process.stdout`` (the error when it exits early)."""
    port = free_port()
    process = subprocess.Popen([sys.executable, *command, "--port", str(port)], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(process.stdout.read())
        try:
            if httpx.get(url + health, timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.3)
    process.kill()
    raise AssertionError(f"no server on {url}")
