"""A real HTTP server in a thread for tests that need a peer to misbehave on purpose (a reward model, a judge):
the handler class decides what each request gets; ``send`` writes a JSON body (or raw text, for garbage)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class StubHandler(BaseHTTPRequestHandler):
    """Quiet, with ``body()`` and ``send()``; subclasses implement ``do_GET`` / ``do_POST``."""

    def log_message(self, *args: Any) -> None:
        pass

    def body(self) -> Any:
        return json.loads(self.rfile.read(int(self.headers["Content-Length"])))

    def send(self, payload: Any, status: int = 200) -> None:
        raw = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)


@contextmanager
def running(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """Serve ``handler`` on a free loopback port; yields the base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
