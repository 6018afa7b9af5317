"""Ports for the servers the tests start, reserved for the rest of the test process.

``verl.utils.net.free_port`` releases its port when it returns; a server process that imports torch before it
binds leaves seconds in which, on a box running other tests' load beside it, any outgoing connection can take that
port as its source port. Here the port stays bound (``reserve_port``: ``SO_REUSEADDR``, never listening) until the
process exits, so only the server the test starts, binding it explicitly, can use it — and an address nobody
serves (a "down" upstream) stays down."""

from __future__ import annotations

import socket

from verl.utils.net import reserve_port

_HELD: list[socket.socket] = []  # open until the test process exits: the reservations


def free_port() -> int:
    sock = reserve_port()
    _HELD.append(sock)
    return int(sock.getsockname()[1])
