"""Loopback networking helpers shared by the trainer (process-group rendezvous), the dashboard, the load test,
benchmarks and tests."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A free TCP port on the loopback interface (the OS picks it; free when checked, so bind it soon)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])
