"""uvicorn's h11 protocol with a deadline on request headers (``verl serve`` uses it).

uvicorn closes idle keep-alive connections (``--timeout-keep-alive``) but waits forever for a request whose headers
never finish: a few hundred half-sent connections ("slowloris") hold sockets and memory indefinitely. The ASGI app
only sees a request once its headers are complete, so this deadline cannot live in the app; it lives here, in the
connection. Bodies that stall are the app's job (``EdgeGuard`` in ``serve/api.py``, ``body_timeout_s``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_HEADER_TIMEOUT_S = 10.0


class HeaderDeadlineH11Protocol(H11Protocol):
    """Closes a connection whose request line and headers are not complete ``header_timeout_s`` after it opened
    (or after its previous response, on a kept-alive connection that has started sending the next request)."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm_header_deadline()  # bytes of a request, headers not complete yet: the clock runs
        else:
            self._disarm_header_deadline()  # headers done: the app (and its body timeout) takes over

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        if self._header_deadline is None:
            self._header_deadline = self.loop.call_later(self.header_timeout_s, self._on_header_deadline)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _on_header_deadline(self) -> None:
        self._header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def protocol_with_header_timeout(seconds: float) -> type[HeaderDeadlineH11Protocol]:
    """A protocol class for ``uvicorn.run(http=...)`` with this header deadline."""
    return type("HeaderDeadlineH11Protocol", (HeaderDeadlineH11Protocol,), {"header_timeout_s": float(seconds)})
