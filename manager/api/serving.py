"""How the manager's HTTP server is run: uvicorn, plus the limits uvicorn lacks.

uvicorn has no timeout on receiving a request: its keep-alive timer only covers the idle
time between two requests and is cancelled by every byte received, so a client that sends
its headers, or its body, one byte at a time (slow loris) holds a connection for ever, and a
few hundred of them take every place ``limit_concurrency`` allows (503 to everyone else).
:class:`RequestDeadlineProtocol` gives each request two deadlines that no trickle of bytes
restarts: the request line + headers within ``header_timeout_s`` of the connection's start
or of the previous response's end, then the body within ``body_timeout_s`` of the head's
end (408, then close). A keep-alive connection older than ``CONNECTION_MAX_S`` is closed
after its current response, so no client holds one for ever either.
``limit_concurrency`` answers 503 to new requests above that many connections + tasks, and
``timeout_graceful_shutdown`` lets SIGTERM end the server within a few seconds whatever
its clients do (uvicorn otherwise waits for every open connection to finish).

It subclasses uvicorn's h11 protocol and relies on its internals (``conn``, ``transport``,
``loop``, ``connection_made``, ``data_received``, ``on_response_complete``,
``connection_lost``, ``shutdown``): pyproject pins uvicorn's upper version, and
tests/unit/test_http_limits.py fails naming the internal when an upgrade changes one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

#: Seconds a connection has to send a complete request line + headers.
HEADER_TIMEOUT_S = 10.0
#: Seconds a request has to send its whole body once its head came (a 1 MiB report at
#: 50 KiB/s).
BODY_TIMEOUT_S = 20.0
#: Seconds after which a keep-alive connection is closed at the end of its response.
CONNECTION_MAX_S = 120.0
#: Connections + running requests above which new requests are answered 503.
LIMIT_CONCURRENCY = 500
#: Seconds an idle keep-alive connection stays open (uvicorn's default, stated here).
KEEP_ALIVE_S = 5
#: Seconds SIGTERM waits for open requests before it cancels them and the manager exits.
SHUTDOWN_GRACE_S = 3

_TIMEOUT_REPLY = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                  b"content-length: 16\r\nconnection: close\r\n\r\nrequest timeout\n")


class RequestDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's head and on its body."""

    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    connection_max_s: float = CONNECTION_MAX_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._deadline_state: object = None
        """What the running deadline is for: h11.IDLE (the head) or h11.SEND_BODY."""
        self._opened_at = time.monotonic()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._follow_request_state()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_request_state()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if (not self.transport.is_closing()
                and time.monotonic() - self._opened_at > self.connection_max_s):
            self.transport.close()  # its answer is whole: the client opens another
        self._follow_request_state()  # a keep-alive connection: the next request's deadline

    def shutdown(self) -> None:
        """SIGTERM: a request whose body is still arriving is dropped at once (nothing was
        answered: its client may send it again), the others end as uvicorn ends them."""
        if not self.transport.is_closing() and self.conn.their_state is h11.SEND_BODY:
            self.transport.close()
            return
        super().shutdown()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _follow_request_state(self) -> None:
        """A deadline runs while the client owes the head (h11 says IDLE) and, from then
        on, while it owes the body (SEND_BODY); bytes that trickle in restart neither."""
        state = None if self.transport.is_closing() else self.conn.their_state
        if state is not self._deadline_state:
            self._disarm()
            if state is h11.IDLE or state is h11.SEND_BODY:
                timeout = self.header_timeout_s if state is h11.IDLE else self.body_timeout_s
                self._deadline = self.loop.call_later(timeout, self._expired)
                self._deadline_state = state

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._deadline_state = None, None

    def _expired(self) -> None:
        state = self._deadline_state
        self._deadline, self._deadline_state = None, None
        if self.transport.is_closing() or self.conn.their_state is not state:
            return
        part = "head" if state is h11.IDLE else "body"
        # Part of a request came and nothing was answered yet: say why (408), then close.
        started = self.conn.trailing_data[0] if state is h11.IDLE else True
        if started and self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            self.transport.write(_TIMEOUT_REPLY)
        logger.debug("closing a connection from %s: no complete request %s in %.0f s",
                     self.client, part,
                     self.header_timeout_s if state is h11.IDLE else self.body_timeout_s)
        self.transport.close()


def uvicorn_options(header_timeout_s: float = HEADER_TIMEOUT_S,
                    body_timeout_s: float = BODY_TIMEOUT_S) -> dict[str, Any]:
    """The keyword arguments the manager gives ``uvicorn.run`` / ``uvicorn.Config``."""
    protocol: type[RequestDeadlineProtocol] = RequestDeadlineProtocol
    if (header_timeout_s, body_timeout_s) != (HEADER_TIMEOUT_S, BODY_TIMEOUT_S):
        protocol = type("RequestDeadlineProtocol", (RequestDeadlineProtocol,),
                        {"header_timeout_s": header_timeout_s,
                         "body_timeout_s": body_timeout_s})
    return {"http": protocol, "limit_concurrency": LIMIT_CONCURRENCY,
            "timeout_keep_alive": KEEP_ALIVE_S, "log_level": "warning",
            "timeout_graceful_shutdown": SHUTDOWN_GRACE_S}
