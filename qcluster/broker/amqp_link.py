"""The RabbitMQ backend's link: URL options, one kombu connection with retries and
reconnects, its epoch, heartbeats (sent by a thread, checked when reading), reading
frames, and the channel used to inspect queues. The other parts of
:class:`~qcluster.broker.kombu_broker.KombuBroker` (topology, publisher, consumers, job
reads) each hold this :class:`AmqpLink` and call it."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import amqp

from qcluster.broker.amqp_readahead import Connection
from qcluster.broker.base import mask_url, unreachable
from qcluster.broker.urls import join_urls, split_urls
from qcluster.errors import BrokerError, BrokerUnavailable

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Longest single blocking read, so SIGTERM and master commands are noticed.
MAX_BLOCK_S = 1.0
#: Connection options read from the URL's query (seconds) and their defaults.
URL_OPTIONS = {"heartbeat": 10.0, "connect_timeout": 5.0, "write_timeout": 10.0}


def split_url_options(url: str) -> tuple[str, dict[str, float]]:
    """The URL(s) without qcluster's connection options, and those options (seconds).

    kombu would pass ``connect_timeout`` on as a string and refuses unknown options with
    a TypeError; here they are numbers, checked, with defaults (:data:`URL_OPTIONS`).
    """
    options = dict(URL_OPTIONS)
    urls = []
    for one in split_urls(url):
        parts = urlsplit(one)
        rest = []
        for piece in parts.query.split("&") if parts.query else []:
            ((key, value),) = parse_qsl(piece, keep_blank_values=True) or [("", "")]
            if key not in URL_OPTIONS:
                rest.append(piece)  # as written: kombu reads it
                continue
            try:
                seconds = float(value)
            except ValueError:
                seconds = math.nan
            if not math.isfinite(seconds) or seconds < 0 or seconds > 3600:
                raise BrokerError(
                    f"RabbitMQ URL option {key}={value!r}: want seconds between 0 and 3600"
                )
            options[key] = seconds
        urls.append(urlunsplit(parts._replace(query="&".join(rest))))
    return join_urls(urls), options



class AmqpLink:
    """One kombu connection (failover URLs round-robin) and what every part needs of it.

    ``epoch`` counts the connections: it grows each time the connection is lost, so a
    delivery tag of an earlier connection (a delivery's receipt is ``(epoch, tag)``) is
    never taken for one of this connection. ``on_lost`` is called first when the
    connection is lost or closed, so the parts built on it forget their channels, before
    the link forgets its own (:meth:`lost`); ``on_wait`` between reconnect attempts.

    ``give_up_s``: a call stops retrying that long after it began (a short-lived caller,
    :data:`~qcluster.broker.base.SHORT_LIVED_GIVE_UP_S`); None: only ``max_retries``
    bounds it, each connect retried with backoff (long-lived processes)."""

    def __init__(
        self, url: str, *, max_retries: int, connect_timeout_s: float | None,
        confirm_timeout_s: float, on_lost: Callable[[], None] = lambda: None,
        on_wait: Callable[[], None] = lambda: None, give_up_s: float | None = None,
    ) -> None:
        kombu_url, options = split_url_options(url)
        self.url = url
        self.safe_url = mask_url(url)
        self.max_retries = max_retries
        self.give_up_s = give_up_s
        self.confirm_timeout_s = confirm_timeout_s
        self.heartbeat_s = options["heartbeat"]
        self.on_lost = on_lost
        self.on_wait = on_wait
        self.conn = Connection(
            kombu_url,
            failover_strategy="round-robin",
            transport_options={"write_timeout": options["write_timeout"] or None},
            connect_timeout=connect_timeout_s or options["connect_timeout"],
            heartbeat=self.heartbeat_s,
        )
        self.recoverable: tuple[type[BaseException], ...] = (
            *self.conn.recoverable_connection_errors,
            *self.conn.recoverable_channel_errors,
            OSError,
        )
        self.epoch = 0
        self._inspect: Any = None
        self._closed = threading.Event()
        self._beats: threading.Thread | None = None
        self._live: Any = None
        """The py-amqp connection connect() last saw (the heartbeat thread's)."""
        self._next_tick = 0.0
        self.blocked_at: float | None = None
        """time.monotonic() when the broker blocked this connection's publishing (a
        resource alarm: memory or disk), None while it does not."""

    # --- connection handling --------------------------------------------------

    def connect(self, deadline: float | None = None) -> None:
        """Connect unless connected, retrying with backoff ``max_retries`` times, and not
        after ``deadline`` (time.monotonic()): the attempt under way when it passes ends
        at its connect timeout."""
        # kombu's own bound, total over its retries (0 would mean none: at least 1 ms).
        timeout = None if deadline is None else max(deadline - time.monotonic(), 0.001)
        try:
            self.conn.ensure_connection(
                max_retries=self.max_retries, interval_start=0.2, interval_step=0.5,
                interval_max=3.0, errback=lambda exc, interval: self.on_wait(), timeout=timeout,
            )
        except Exception as exc:
            raise BrokerUnavailable(unreachable("RabbitMQ", self.safe_url, exc)) from exc
        # The live py-amqp connection, for the heartbeat thread (which must never connect):
        # kombu may have reconnected inside ensure_connection, so read it every time.
        live = self.conn.connection
        if live is not self._live:
            # Told when the broker blocks and unblocks publishing (py-amqp reads these at
            # each frame; kombu does not pass them: tests/contract/test_kombu_internals.py).
            live.on_blocked, live.on_unblocked = self._blocked, self._unblocked
        self._live = live
        if self._beats is None and self.heartbeat_s > 0:
            self._beats = threading.Thread(
                target=self._send_heartbeats, args=(self._closed,),
                name="qcluster-amqp-heartbeat", daemon=True,
            )
            self._beats.start()

    def _send_heartbeats(self, closed: threading.Event) -> None:
        """Keep the link alive while the slot's thread is busy in a handler: py-amqp
        only sends heartbeats when asked, and a batch may run longer than two of them
        (the broker would then drop the connection and hand the batch out again).
        Writing a frame from here is safe: py-amqp serialises frame writes with a lock.
        Receiving stays on the slot's thread, which checks the broker's heartbeats."""
        while not closed.wait(self.heartbeat_s / 2):
            connection = self._live  # None while disconnected; never connect here
            try:
                if connection is not None and connection.connected:
                    connection.send_heartbeat()
            except Exception:  # the slot's thread finds out and reconnects
                logger.debug("sending a heartbeat failed", exc_info=True)

    def _blocked(self, reason: str) -> None:
        self.blocked_at = time.monotonic()
        # A short-lived caller gives up give_up_s after the block (amqp_publish.Publisher).
        wait_s = self.confirm_timeout_s if self.give_up_s is None else self.give_up_s
        logger.warning("RabbitMQ at %s blocks publishing (a resource alarm, memory or disk: "
                       "see its log): jobs wait to be stored until it unblocks, at most %g s "
                       "each", self.safe_url, wait_s)

    def _unblocked(self) -> None:
        if self.blocked_at is not None:
            logger.warning("RabbitMQ at %s unblocked publishing after %.1f s", self.safe_url,
                           time.monotonic() - self.blocked_at)
        self.blocked_at = None

    def read_received(self, most: int = 100) -> None:
        """Handle the frames already received, without waiting for more (at most ``most``
        methods): a connection.blocked or unblocked the broker sent while we were idle."""
        for _ in range(most):
            if not self.drain(0.0):
                return

    def blocks_short_lived(self) -> bool:
        """Whether this is a short-lived caller's connection that the broker blocks, after
        reading the frames already received (an unblock may be among them). Long-lived
        processes wait for the alarm to clear: always False for them."""
        if self.give_up_s is None or self.blocked_at is None:
            return False
        self.read_received()
        return self.blocked_at is not None

    def _not_blocked(self) -> None:
        """A short-lived caller's request (a count, a declare) does not go out on a
        connection the broker blocks: the broker reads nothing from it until the alarm
        clears, so the request would wait that long. Raising a connection error here makes
        :meth:`retrying` drop it and run the request again on a new connection, which the
        broker reads until it publishes. (A publish is refused before: amqp_publish.)"""
        if self.blocks_short_lived():
            raise ConnectionAbortedError("it blocks this connection (its memory or disk "
                                         "alarm) and reads nothing from it: opening another")

    def lost(self) -> None:
        """Forget every channel: the broker returns their unacked jobs by itself. The
        parts built on the link forget theirs first (``on_lost``), then the epoch grows."""
        self.on_lost()
        self.epoch += 1
        self._live = None
        self.blocked_at = None  # a new connection is told again if it is blocked
        self._inspect = None
        try:
            self.conn.collect()
        except Exception:  # best effort on a connection that is already broken
            logger.debug("collect after a connection error failed", exc_info=True)

    def retrying(self, op: Callable[[], T]) -> T:
        """``op`` on a live connection; after a recoverable error the connection is
        lost (:meth:`lost`) and ``op`` runs again, at most ``max_retries`` more times and,
        with ``give_up_s``, not once that long has passed since the call began."""
        deadline = None if self.give_up_s is None else time.monotonic() + self.give_up_s
        for attempt in range(self.max_retries + 1):
            try:
                self.connect(deadline)
                return op()
            except BrokerError:
                raise
            except self.recoverable as exc:
                logger.warning("RabbitMQ at %s: %s (attempt %d)", self.safe_url, exc, attempt + 1)
                self.lost()
                if attempt == self.max_retries or (
                        deadline is not None and time.monotonic() >= deadline):
                    raise BrokerUnavailable(unreachable("RabbitMQ", self.safe_url, exc)) from exc
                self.on_wait()
                time.sleep(min(0.1 * 2**attempt, 2.0))
            except amqp.exceptions.AMQPError as exc:
                self.lost()
                raise BrokerError(f"RabbitMQ at {self.safe_url}: {exc}") from exc
        raise AssertionError("unreachable")

    def drain(self, timeout_s: float, *, every_buffered: bool = False) -> bool:
        """Process incoming frames for up to ``timeout_s``, until one method is complete;
        False when none came. ``every_buffered``: then every frame already received too
        (a consumer reading its deliveries, a few hundred per read). Not for a caller
        waiting for a reply: a frame behind it (a consumer's cancel, a channel's close)
        would raise after the reply came (a publish confirmed, then sent again).

        Heartbeats are checked after reading (whatever arrived while a handler ran is
        read first), so a silent link raises ConnectionForced after two intervals."""
        try:
            raw = self.conn.connection
            # None: not our connection class (or one method wanted).
            drain = getattr(raw, "drain_buffered", None) if every_buffered else None
            if drain is None:
                self.conn.drain_events(timeout=max(timeout_s, 0.001))
            else:
                drain(timeout=max(timeout_s, 0.001))
            got = True
        except TimeoutError:  # socket.timeout is an alias
            got = False
        if self.heartbeat_s and time.monotonic() >= self._next_tick:
            # py-amqp's tick costs more than a frame: at most a few times per heartbeat.
            self._next_tick = time.monotonic() + self.heartbeat_s / 4
            self.conn.connection.heartbeat_tick(rate=2)
        return got

    # --- inspecting -----------------------------------------------------------

    def inspector(self) -> Any:
        """The channel that declares and counts queues (opened when first needed)."""
        self._not_blocked()
        if self._inspect is None:
            self._inspect = self.conn.channel()
        return self._inspect

    def inspector_closed(self) -> None:
        """The broker closed the inspecting channel (a refused declare): open another."""
        self._inspect = None

    def count(self, name: str) -> int:
        """Ready messages in queue ``name``; 0 when it does not exist."""
        try:
            return int(self.inspector().queue_declare(name, passive=True).message_count)
        except amqp.exceptions.NotFound:
            self._inspect = None  # the broker closed the channel
            return 0

    def exists(self, name: str) -> bool:
        try:
            self.inspector().queue_declare(name, passive=True)
            return True
        except amqp.exceptions.NotFound:
            self._inspect = None
            return False

    def close(self) -> None:
        """Close the connection; a short-lived caller's that the broker blocks is dropped
        (:meth:`lost` closes its socket) without the close handshake, whose reply would
        only come once the alarm clears: the broker reads nothing from it before."""
        self._closed.set()  # stops the heartbeat thread
        self._closed, self._beats = threading.Event(), None
        if self.give_up_s is not None and self.blocked_at is not None:
            self.lost()
            return
        try:
            self.conn.release()
        except Exception:  # closing a broken connection: nothing left to release
            logger.debug("closing the RabbitMQ connection failed", exc_info=True)
        self.lost()
