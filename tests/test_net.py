"""``verl.utils.net``: a reserved port is kept from every other socket but the server that binds it."""

from __future__ import annotations

import socket

import pytest

from verl.utils.net import LOOPBACK, reserved_port


def test_a_reserved_port_is_held_from_other_sockets_yet_a_server_binds_it():
    with reserved_port() as port:
        with socket.socket() as plain, pytest.raises(OSError):  # no SO_REUSEADDR: the port is taken
            plain.bind((LOOPBACK, port))
        others = []
        try:
            for _ in range(200):  # the OS never hands it out for bind(0), even to a SO_REUSEADDR socket
                sock = socket.socket()
                others.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((LOOPBACK, 0))
                assert sock.getsockname()[1] != port
        finally:
            for sock in others:
                sock.close()
        with socket.socket() as server:  # what uvicorn (asyncio) does: SO_REUSEADDR, bind, listen
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind((LOOPBACK, port))
            server.listen()
            with socket.create_connection((LOOPBACK, port), timeout=5) as client:
                accepted, _ = server.accept()
                client.sendall(b"ok")
                assert accepted.recv(2) == b"ok"
                accepted.close()
    with reserved_port() as unused:
        pass
    with socket.socket() as plain:  # released with the block
        plain.bind((LOOPBACK, unused))
