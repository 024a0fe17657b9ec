"""How the manager's HTTP server is run: uvicorn, plus the limits uvicorn lacks.

uvicorn has no timeout on receiving a request: its keep-alive timer only covers the idle
time between two requests and is cancelled by every byte received, so a client that sends
its headers one byte at a time (slow loris) holds a connection for ever, and a few hundred
of them exhaust the manager's file descriptors. :class:`HeaderDeadlineProtocol` closes a
connection whose request line and headers are not complete within ``header_timeout_s``
(408, then close) of the connection's start or of the previous response's end; a request
whose headers arrived is not limited (a slow body or a slow answer is the app's business).
``limit_concurrency`` answers 503 to new requests above that many connections + tasks.

It subclasses uvicorn's h11 protocol and relies on its internals (``conn``, ``transport``,
``loop``, ``connection_made``, ``data_received``, ``on_response_complete``,
``connection_lost``): pyproject pins uvicorn's upper version, and
tests/unit/test_http_limits.py fails naming the internal when an upgrade changes one.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("qcluster.manager")

#: Seconds a connection has to send a complete request line + headers.
HEADER_TIMEOUT_S = 10.0
#: Connections + running requests above which new requests are answered 503.
LIMIT_CONCURRENCY = 500
#: Seconds an idle keep-alive connection stays open (uvicorn's default, stated here).
KEEP_ALIVE_S = 5

_TIMEOUT_REPLY = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                  b"content-length: 16\r\nconnection: close\r\n\r\nrequest timeout\n")


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's line + headers."""

    header_timeout_s: float = HEADER_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._follow_request_state()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_request_state()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_request_state()  # a keep-alive connection: the next request's deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _follow_request_state(self) -> None:
        """Armed while the client has not sent a complete request head (h11 says IDLE);
        a deadline already running is not restarted by the bytes that trickle in."""
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            self._disarm()
        elif self._header_deadline is None:
            self._header_deadline = self.loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _expired(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0]:  # part of a request came: say why (408), then close
            self.transport.write(_TIMEOUT_REPLY)
        logger.debug("closing a connection from %s: no complete request head in %.0f s",
                     self.client, self.header_timeout_s)
        self.transport.close()


def uvicorn_options(header_timeout_s: float = HEADER_TIMEOUT_S) -> dict[str, Any]:
    """The keyword arguments the manager gives ``uvicorn.run`` / ``uvicorn.Config``."""
    protocol: type[HeaderDeadlineProtocol] = HeaderDeadlineProtocol
    if header_timeout_s != HEADER_TIMEOUT_S:
        protocol = type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,),
                        {"header_timeout_s": header_timeout_s})
    return {"http": protocol, "limit_concurrency": LIMIT_CONCURRENCY,
            "timeout_keep_alive": KEEP_ALIVE_S, "log_level": "warning"}
