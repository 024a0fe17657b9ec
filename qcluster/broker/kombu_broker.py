"""The RabbitMQ backend through kombu (``amqp://``, ``pyamqp://``; ``;`` joins failover URLs).

How the queue-server contract maps onto AMQP (README, "Backend semantics"):

- A queue NAME is a durable classic queue bound to its own durable topic exchange
  ``qc.q.NAME``. Its dead-letter store is the durable queue ``qc~dead.NAME`` (at most
  10,000 messages and 14 days, applied by RabbitMQ) and its
  delay ladder is named from ``qc~delay.NAME``: ``~`` is not allowed in a queue name
  (:mod:`qcluster.names`), so no queue can be another queue's store or ladder.
- ``take`` is a kombu consumer with ``prefetch_count`` = the batch size and
  ``accept=["application/json"]``: the broker's own unacked state is the lock, so taking
  and locking are one server-side step. A slot whose handler is fast asks for read-ahead
  (``settle_and_take``): prefetch twice the batch, so the next batch streams in while
  this one runs. Frames are read through a read-ahead socket buffer
  (:mod:`qcluster.broker.amqp_readahead`). Unacked jobs come back when the slot's
  connection closes (killed, crashed, its master killed it when hung, or heartbeats
  found the link dead); a job taken but never settled (``on_error="lock"``) is given back
  by the slot itself at its next take after ``lock_timeout``.
- ``settle`` acks a whole batch with one ``multiple=True`` ack when it can (acks have no
  reply, so settling a done batch costs no round trip); postponed, released and dead
  jobs are first republished (publisher confirms) and only then acked, so a crash in
  between duplicates a job and never loses one.
- Leaving a queue (``leave``, or a ``take`` from another queue) cancels its consumer and
  republishes its read-ahead deliveries unchanged, so they are not charged an attempt.
- Every publish is ``mandatory``: a message no queue took (the queue was deleted behind
  our back) comes back as ``basic.return``; the queue is declared again and the message
  published once more, and an enqueue either stores every job or raises.
- Delays use kombu's native delayed delivery (the TTL + dead-letter ladder of 28 binary
  levels), one ladder per queue so that ``stats`` can count the queue's delayed jobs.
  Delays are whole seconds, rounded up.
- Attempts: a header records the takes before this copy of the message; a take adds
  one. A message the broker redelivers (its consumer died) is republished with the
  header incremented and marked suspect, and the original acked, so crashes count too
  (quorum queues' ``x-delivery-count`` is used instead when present).
- A message whose properties or headers cannot be read is handed to the slot marked
  ``malformed`` (the slot dead-letters it); nothing a producer sends stops a slot.
- Heartbeats (``?heartbeat=`` seconds in the URL, default 10) are sent by a small thread
  (so a long batch keeps the link alive) and checked each time frames are read, so a
  dead link ends in a reconnect or a clear error; ``?connect_timeout=`` and
  ``?write_timeout=`` bound connecting and writing.
- ``stats``: ready and delayed come from the broker (``queue_declare(passive=True)``);
  AMQP cannot report other consumers' unacked messages, so ``locked`` counts only what
  this process holds.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from math import isfinite
from typing import Any, TypeVar, cast
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import amqp
from kombu import Consumer, Exchange, Queue
from kombu.transport import native_delayed_delivery as ndd

from qcluster.broker.amqp_readahead import Connection
from qcluster.broker.base import Broker, DeadJob, QueueStats, Settlement
from qcluster.errors import BrokerError, BrokerUnavailable
from qcluster.job import JSON_CONTENT_TYPE, Delivery
from qcluster.names import check_queue_name

logger = logging.getLogger(__name__)

T = TypeVar("T")

ATTEMPTS_HEADER = "x-qc-attempts"
ACTIVATE_HEADER = "x-qc-activate-at"
REASON_HEADER = "x-qc-reason"
DEAD_AT_HEADER = "x-qc-dead-at"
#: Present on a copy republished after its take ended without a settle (its slot died,
#: or a lock expired): the slot runs it alone.
SUSPECT_HEADER = "x-qc-suspect"
#: The ladder's top level; kombu publishes every delayed message there.
TOP_LEVEL = ndd.MAX_LEVEL
#: Longest single blocking read, so SIGTERM and master commands are noticed.
MAX_BLOCK_S = 1.0
#: After the first message of a batch arrived, how long to wait for the rest of it.
BATCH_FILL_S = 0.005
#: dead_jobs reads at most this many dead messages to find the newest ones.
DEAD_SCAN_LIMIT = 10_000
#: Dead letters kept per queue, as on Redis (the store's x-max-length and x-message-ttl).
DEAD_MAX_COUNT = 10_000
DEAD_MAX_AGE_S = 14 * 24 * 3600.0
#: Connection options read from the URL's query (seconds) and their defaults.
URL_OPTIONS = {"heartbeat": 10.0, "connect_timeout": 5.0, "write_timeout": 10.0}


def mask_url(url: str) -> str:
    masked = []
    for one in url.split(";"):
        parts = urlsplit(one)
        if parts.password:
            netloc = parts.netloc.replace(f":{parts.password}@", ":**@")
            one = urlunsplit(parts._replace(netloc=netloc))
        masked.append(one)
    return ";".join(masked)


def split_url_options(url: str) -> tuple[str, dict[str, float]]:
    """The URL(s) without qcluster's connection options, and those options (seconds).

    kombu would pass ``connect_timeout`` on as a string and refuses unknown options with
    a TypeError; here they are numbers, checked, with defaults (:data:`URL_OPTIONS`).
    """
    options = dict(URL_OPTIONS)
    urls = []
    for one in url.split(";"):
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
    return ";".join(urls), options


def ladder_prefix(queue: str) -> str:
    return f"qc~delay.{queue}"


def queue_exchange(queue: str) -> Exchange:
    return Exchange(f"qc.q.{queue}", type="topic", durable=True)


def dead_queue_name(queue: str) -> str:
    return f"qc~dead.{queue}"


def legacy_dead_queue_name(queue: str) -> str:
    """Where earlier versions kept dead letters (a queue could have that name)."""
    return f"{queue}.dead"


@dataclass
class _Consumer:
    """One queue's consumer on its own channel: delivery tags (and multiple acks)
    never mix queues."""

    channel: Any
    consumer: Consumer | None
    prefetch: int
    buffer: deque[Any] = field(default_factory=deque)
    """Delivered by the broker, not yet handed out by take (already unacked/locked)."""
    held: dict[int, Delivery] = field(default_factory=dict)
    """Handed out by take, not yet settled: delivery tag -> delivery."""
    takes: deque[tuple[float, list[Delivery]]] = field(default_factory=deque)
    """Each take's lock expiry (monotonic) and deliveries, oldest first."""
    undecodable: dict[int, str] = field(default_factory=dict)
    """Delivery tag -> why kombu could not read the message."""

    def unacked(self) -> set[int]:
        return set(self.held) | {m.delivery_tag for m in self.buffer}

    def on_decode_error(self, message: Any, exc: BaseException) -> None:
        self.undecodable[message.delivery_tag] = f"malformed: {type(exc).__name__}: {exc}"
        self.buffer.append(message)


class _ChannelTracker:
    """Stands in for a Connection: remembers the channels it opened, to close them."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.opened: list[Any] = []

    def channel(self) -> Any:
        channel = self.conn.channel()
        self.opened.append(channel)
        return channel

    def close(self) -> None:
        for channel in self.opened:
            try:
                channel.close()
            except Exception:  # a channel the broker closed (an error) is gone already
                logger.debug("closing a declaring channel failed", exc_info=True)


class _Confirms:
    """Publisher confirms and returns (mandatory) for many messages on one channel."""

    def __init__(self, channel: Any) -> None:
        self.published = 0
        self.acked: set[int] = set()
        self.acked_upto = 0
        self.nacked = False
        self.returned: list[Any] = []
        channel.events["basic_ack"].add(self._on_ack)
        channel.events["basic_nack"].add(self._on_nack)
        channel.events["basic_return"].add(self._on_return)
        channel._confirm_selected = True  # the confirm_publish transport option's flag
        channel.confirm_select()

    def _on_ack(self, tag: int, multiple: bool) -> None:
        if multiple:
            self.acked_upto = max(self.acked_upto, tag)
        else:
            self.acked.add(tag)

    def _on_nack(self, tag: int, multiple: bool) -> None:
        self.nacked = True

    def _on_return(self, exc: Exception, exchange: str, routing_key: str, message: Any) -> None:
        # RabbitMQ sends a message's basic.return before its confirm.
        self.returned.append(message)

    def all_confirmed(self) -> bool:
        if self.nacked:
            raise BrokerError("RabbitMQ refused (nacked) a published message")
        while self.acked_upto + 1 in self.acked:
            self.acked_upto += 1
            self.acked.discard(self.acked_upto)
        return self.acked_upto >= self.published


class KombuBroker(Broker):
    """Queue server on RabbitMQ through kombu (see the module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        max_retries: int = 5,
        connect_timeout_s: float | None = None,
        confirm_timeout_s: float = 30.0,
        dead_max_count: int = DEAD_MAX_COUNT,
        dead_max_age_s: float = DEAD_MAX_AGE_S,
    ) -> None:
        kombu_url, options = split_url_options(url)
        self.url = url
        self.safe_url = mask_url(url)
        self.max_retries = max_retries
        self.confirm_timeout_s = confirm_timeout_s
        self.heartbeat_s = options["heartbeat"]
        # RabbitMQ applies them itself: the oldest dead letter is dropped past the count,
        # any is dropped past the age. Fixed when the store is first declared.
        self._dead_arguments = {"x-max-length": dead_max_count, "x-overflow": "drop-head",
                                "x-message-ttl": round(dead_max_age_s * 1000)}
        self.conn = Connection(
            kombu_url,
            failover_strategy="round-robin",
            transport_options={"confirm_publish": True,
                               "write_timeout": options["write_timeout"] or None},
            connect_timeout=connect_timeout_s or options["connect_timeout"],
            heartbeat=self.heartbeat_s,
        )
        self._recoverable: tuple[type[BaseException], ...] = (
            *self.conn.recoverable_connection_errors,
            *self.conn.recoverable_channel_errors,
            OSError,
        )
        self._generation = 0
        self._consumers: dict[str, _Consumer] = {}
        self._active: str | None = None
        """The queue last taken from: taking from another one leaves it."""
        self._declared: set[str] = set()
        self._laddered: set[str] = set()
        self._seen: set[str] = set()
        self._pub: Any = None
        self._confirms: _Confirms | None = None
        self._inspect: Any = None
        self._closed = threading.Event()
        self._beats: threading.Thread | None = None
        self._next_tick = 0.0

    @classmethod
    def from_url(cls, url: str) -> KombuBroker:
        return cls(url)

    # --- connection handling --------------------------------------------------

    def _connect(self) -> None:
        try:
            self.conn.ensure_connection(
                max_retries=self.max_retries, interval_start=0.2, interval_step=0.5,
                interval_max=3.0,
            )
        except Exception as exc:
            raise BrokerUnavailable(f"RabbitMQ at {self.safe_url} unreachable: {exc}") from exc
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
            connection = self.conn._connection  # None while disconnected; never connect here
            try:
                if connection is not None and connection.connected:
                    connection.send_heartbeat()
            except Exception:  # the slot's thread finds out and reconnects
                logger.debug("sending a heartbeat failed", exc_info=True)

    def _reset(self) -> None:
        """Forget every channel: the broker returns their unacked jobs by itself."""
        self._generation += 1
        self._consumers.clear()
        self._active = None
        self._declared.clear()
        self._laddered.clear()
        self._pub = self._confirms = self._inspect = None
        try:
            self.conn.collect()
        except Exception:  # best effort on a connection that is already broken
            logger.debug("collect after a connection error failed", exc_info=True)

    def _retrying(self, op: Callable[[], T]) -> T:
        for attempt in range(self.max_retries + 1):
            try:
                self._connect()
                return op()
            except BrokerError:
                raise
            except self._recoverable as exc:
                logger.warning("RabbitMQ at %s: %s (attempt %d)", self.safe_url, exc, attempt + 1)
                self._reset()
                if attempt == self.max_retries:
                    raise BrokerUnavailable(
                        f"RabbitMQ at {self.safe_url} unreachable: {exc}"
                    ) from exc
                time.sleep(min(0.1 * 2**attempt, 2.0))
            except amqp.exceptions.AMQPError as exc:
                self._reset()
                raise BrokerError(f"RabbitMQ at {self.safe_url}: {exc}") from exc
        raise AssertionError("unreachable")

    def _drain(self, timeout_s: float) -> bool:
        """Process incoming frames for up to ``timeout_s``; False when none came.

        Heartbeats are checked after reading (whatever arrived while a handler ran is
        read first), so a silent link raises ConnectionForced after two intervals."""
        try:
            self.conn.drain_events(timeout=max(timeout_s, 0.001))
            got = True
        except TimeoutError:  # socket.timeout is an alias
            got = False
        if self.heartbeat_s and time.monotonic() >= self._next_tick:
            # py-amqp's tick costs more than a frame: at most a few times per heartbeat.
            self._next_tick = time.monotonic() + self.heartbeat_s / 4
            self.conn.connection.heartbeat_tick(rate=2)
        return got

    # --- topology -------------------------------------------------------------

    def _declare(self, queue: str) -> None:
        if queue in self._declared:
            return
        channel = self._inspector()
        Queue(queue, queue_exchange(queue), routing_key=queue, durable=True).bind(
            channel
        ).declare()
        Queue(dead_queue_name(queue), durable=True, queue_arguments=self._dead_arguments
              ).bind(channel).declare()
        self._declared.add(queue)
        self._seen.add(queue)

    def _declare_ladder(self, queue: str) -> None:
        """The queue's own delay ladder, routed back to the queue's exchange."""
        if queue in self._laddered:
            return
        prefix = ladder_prefix(queue)
        # kombu's helpers open a channel per call and leave it open: close them here.
        tracker = _ChannelTracker(self.conn)
        try:
            conn = cast(Connection, tracker)
            ndd.declare_native_delayed_delivery_exchanges_and_queues(conn, "classic", prefix)
            main = Queue(queue, queue_exchange(queue), routing_key=queue, durable=True)
            ndd.bind_queue_to_native_delayed_delivery_exchange(conn, main, prefix)
        finally:
            tracker.close()
        self._laddered.add(queue)

    def _forget_topology(self, queue: str) -> None:
        """Someone deleted the queue (or its store, exchange, ladder): declare again."""
        self._declared.discard(queue)
        self._laddered.discard(queue)

    # --- producing ------------------------------------------------------------

    def _publisher(self) -> tuple[Any, _Confirms]:
        if self._pub is None or self._confirms is None:
            self._pub = self.conn.channel()
            self._confirms = _Confirms(self._pub)
        return self._pub, self._confirms

    def _send(
        self, queue: str, items: Iterable[tuple[str, bytes, dict[str, Any]]], delay_s: float,
        *, to_dead: bool = False,
    ) -> None:
        """Publish ``(job_id, body, headers)`` and wait for every publisher confirm."""
        countdown = math.ceil(delay_s) if delay_s > 0 else 0
        activate_at = time.time() + countdown
        messages = [
            amqp.Message(
                body, content_type=JSON_CONTENT_TYPE, delivery_mode=2, message_id=job_id,
                application_headers={ACTIVATE_HEADER: activate_at, **headers},
            )
            for job_id, body, headers in items
        ]
        self._publish(queue, messages, countdown, to_dead=to_dead)

    def _publish(
        self, queue: str, messages: list[Any], countdown: int = 0, *, to_dead: bool = False
    ) -> None:
        """Publish ``messages`` (mandatory, confirmed). One more round after the broker
        returned some (no queue took them) or did not know the exchange: the queue was
        deleted behind our back, so it is declared again. Raises if that fails too."""
        try:
            returned = self._publish_once(queue, messages, countdown, to_dead)
        except amqp.exceptions.NotFound as exc:
            logger.warning("RabbitMQ at %s: %s; declaring %s again", self.safe_url, exc, queue)
            self._pub = self._confirms = self._inspect = None  # the broker closed them
            self._forget_topology(queue)
            returned = self._publish_once(queue, messages, countdown, to_dead)
        if returned:
            logger.warning("RabbitMQ at %s: %d message(s) for %s unroutable; declaring it "
                           "again", self.safe_url, len(returned), queue)
            self._forget_topology(queue)
            if self._publish_once(queue, returned, countdown, to_dead):
                raise BrokerError(
                    f"RabbitMQ at {self.safe_url}: no queue took messages for {queue!r}"
                )

    def _publish_once(
        self, queue: str, messages: list[Any], countdown: int, to_dead: bool
    ) -> list[Any]:
        """Publish and wait for every confirm; returns the messages the broker returned."""
        self._declare(queue)
        if to_dead:
            exchange, routing_key = "", dead_queue_name(queue)
        elif countdown:
            self._declare_ladder(queue)
            exchange = ndd.level_name(TOP_LEVEL, ladder_prefix(queue))
            routing_key = ndd.calculate_routing_key(countdown, queue)
        else:
            exchange, routing_key = queue_exchange(queue).name, queue
        channel, confirms = self._publisher()
        confirms.returned = []
        for message in messages:
            channel._basic_publish(message, exchange=exchange, routing_key=routing_key,
                                   mandatory=True)
            confirms.published += 1
        deadline = time.monotonic() + self.confirm_timeout_s
        while not confirms.all_confirmed():
            if time.monotonic() > deadline:
                raise BrokerUnavailable(f"RabbitMQ at {self.safe_url}: no publisher confirm")
            self._drain(MAX_BLOCK_S)
        return confirms.returned

    def publish_many(
        self, queue: str, messages: Sequence[tuple[str, bytes]], *, delay_s: float = 0.0
    ) -> None:
        check_queue_name(queue)
        items: list[tuple[str, bytes, dict[str, Any]]] = [
            (job_id, body, {}) for job_id, body in messages
        ]
        self._retrying(lambda: self._send(queue, items, delay_s))

    # --- consuming ------------------------------------------------------------

    def _consumer(self, queue: str, room: int, ahead: int = 0) -> _Consumer:
        """The queue's consumer, with a prefetch allowing ``room`` more jobs than held,
        plus ``ahead`` delivered in advance for the next take."""
        self._declare(queue)
        current = self._consumers.get(queue)
        exact = len(current.held) + room if current else room
        wanted = exact + ahead
        if (current and current.consumer is not None and current.prefetch >= wanted
                and (ahead or current.prefetch <= exact)):
            return current
        if current:
            # A consumer's prefetch is fixed when it starts: restart it with the new one.
            # Messages already delivered stay unacked (locked) on this channel.
            if current.consumer is not None:
                current.consumer.cancel()
            state = current
        else:
            state = _Consumer(channel=self.conn.channel(), consumer=None, prefetch=0)
        consumer = Consumer(
            state.channel, queues=[Queue(queue, queue_exchange(queue), routing_key=queue,
                                         durable=True)],
            accept=[JSON_CONTENT_TYPE], on_message=state.buffer.append, auto_declare=False,
            on_decode_error=state.on_decode_error,
        )
        consumer.qos(prefetch_count=wanted)
        consumer.consume()
        state.consumer, state.prefetch = consumer, wanted
        self._consumers[queue] = state
        return state

    def take(
        self, queue: str, *, max_jobs: int, lock_timeout_s: float, wait_s: float = 0.0
    ) -> list[Delivery]:
        check_queue_name(queue)
        return self._retrying(lambda: self._take(queue, max_jobs, wait_s, lock_timeout_s))

    def settle_and_take(
        self, queue: str, settlement: Settlement, *, max_jobs: int, lock_timeout_s: float,
        wait_s: float = 0.0, read_ahead: bool = False,
    ) -> list[Delivery]:
        """Acks have no reply, so the settle costs nothing; with ``read_ahead`` the next
        batch streams in while this one runs instead of after its ack reached the broker
        (which otherwise leaves both the slot and RabbitMQ idle once per batch)."""
        check_queue_name(queue)
        self.settle(queue, settlement)
        ahead = max_jobs if read_ahead else 0
        return self._retrying(
            lambda: self._take(queue, max_jobs, wait_s, lock_timeout_s, ahead)
        )

    def _take(
        self, queue: str, max_jobs: int, wait_s: float, lock_timeout_s: float, ahead: int = 0
    ) -> list[Delivery]:
        if queue != self._active:
            self._leave_others(queue)
        if any(state.held for state in self._consumers.values()):
            self._expire_locks()
        state = self._consumer(queue, max_jobs, ahead)
        if not state.buffer and wait_s <= 0 and self._count(queue) > 0:
            wait_s = 2.0  # ready jobs are on their way: --burst must not stop early
        deadline = time.monotonic() + max(wait_s, BATCH_FILL_S)
        while True:
            while not state.buffer:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                self._drain(min(remaining, MAX_BLOCK_S))
            # The broker streams the batch in: collect what arrives right behind the first.
            while len(state.buffer) < max_jobs and self._drain(BATCH_FILL_S):
                pass
            now = time.time()
            messages: list[Any] = []
            out: list[Delivery] = []
            redelivered: list[Any] = []
            suspect: int | None = None
            buffer, held = state.buffer, state.held
            while buffer and len(out) < max_jobs:
                message = buffer.popleft()
                if _uncounted_redelivery(message):
                    redelivered.append(message)
                    continue
                delivery = self._delivery(state, message, now)
                if delivery.suspect and suspect is None:
                    suspect = len(out)
                held[message.delivery_tag] = delivery
                messages.append(message)
                out.append(delivery)
            if redelivered:
                self._give_back_raw(queue, state, redelivered)
            if suspect is not None:
                out = self._hold_one_suspect(queue, state, out, messages, suspect)
            if out:
                state.takes.append((time.monotonic() + lock_timeout_s, out))
                return out

    def _hold_one_suspect(
        self, queue: str, state: _Consumer, out: list[Delivery], messages: list[Any],
        index: int,
    ) -> list[Delivery]:
        """Hand out the suspect job alone and hold nothing else while it runs: the
        consumer is stopped (the next take starts it again) and the rest of the take and
        of the read-ahead go back unchanged. If the job kills its slot again, only it is
        redelivered and charged, not whatever else the slot had prefetched."""
        if state.consumer is not None:
            state.consumer.cancel()  # waits for cancel-ok: every delivery is in the buffer
            state.consumer = None
        rest = messages[:index] + messages[index + 1:]
        for message in rest:
            del state.held[message.delivery_tag]
        rest += state.buffer
        state.buffer.clear()
        if rest:
            self._give_back_raw(queue, state, rest)
        return [out[index]]

    def _leave_others(self, queue: str) -> None:
        """Taking from ``queue`` now: stop every other queue's consumer (a slot moved to
        another queue must not keep the old one's jobs locked and invisible)."""
        for other, state in list(self._consumers.items()):
            if other != queue:
                self._leave(other, state)
        self._active = queue

    def leave(self, queue: str) -> None:
        """Cancel the queue's consumer and give its read-ahead deliveries back, not
        charged; jobs handed out and not settled stay locked until settled or expired."""
        state = self._consumers.get(queue)
        if state is not None:
            self._retrying(lambda: self._leave(queue, state))
        if self._active == queue:
            self._active = None

    def _leave(self, queue: str, state: _Consumer) -> None:
        if state.consumer is not None:
            state.consumer.cancel()  # waits for cancel-ok: every delivery is in the buffer
            state.consumer = None
        if state.buffer:
            messages = list(state.buffer)
            self._give_back_raw(queue, state, messages)
            state.buffer.clear()
        if not state.held:
            self._consumers.pop(queue, None)
            state.channel.close()

    def _expire_locks(self) -> None:
        """Give back, counted and suspect, the jobs taken more than their lock_timeout
        ago and never settled (``on_error="lock"``): RabbitMQ has no lock timeout."""
        now = time.monotonic()
        for queue, state in list(self._consumers.items()):
            expired: list[Delivery] = []
            while state.takes and state.takes[0][0] <= now:
                _, deliveries = state.takes.popleft()
                expired += [d for d in deliveries if d.receipt[1] in state.held]
            if not state.held:
                state.takes.clear()  # every take settled: nothing can expire
            if expired:
                items = [(d.id, d.body, {ATTEMPTS_HEADER: d.attempts, SUSPECT_HEADER: 1,
                                         ACTIVATE_HEADER: d.activate_at}) for d in expired]
                self._send(queue, items, 0.0)
                self._ack(state, {d.receipt[1] for d in expired})
                if state.consumer is None and not state.held:
                    self._consumers.pop(queue, None)
                    state.channel.close()

    def _give_back_raw(self, queue: str, state: _Consumer, messages: list[Any]) -> None:
        """Republish delivered messages, then ack them: unchanged when they were never
        handed out (no attempt charged), counted and suspect when the broker redelivered
        them (the consumer that had them died). Confirmed before the ack: a crash in
        between duplicates, never loses.

        Classic queues only flag a redelivery; without counting it a job whose slot dies
        every time (a poison job) would count 2 attempts forever and never reach
        max_attempts.
        """
        copies = []
        for message in messages:
            properties = dict(message.properties)
            headers = dict(properties.get("application_headers") or {})
            if _uncounted_redelivery(message):
                attempts = _whole(headers.get(ATTEMPTS_HEADER, 0))
                if attempts is not None:  # an unreadable count stays: the slot dead-letters it
                    headers[ATTEMPTS_HEADER] = attempts + 1
                headers[SUSPECT_HEADER] = 1
                headers.setdefault(ACTIVATE_HEADER, time.time())
            properties["application_headers"] = headers
            properties["delivery_mode"] = 2
            copies.append(amqp.Message(_body(message), **properties))
            state.undecodable.pop(message.delivery_tag, None)
        self._publish(queue, copies)
        for message in messages:
            state.channel.basic_ack(message.delivery_tag)

    def _delivery(self, state: _Consumer, message: Any, now: float) -> Delivery:
        tag = message.delivery_tag
        try:
            headers = message.headers or {}
            attempts = int(headers.get(ATTEMPTS_HEADER, 0)) + 1
            suspect = SUSPECT_HEADER in headers
            if "x-delivery-count" in headers:  # quorum queues count redeliveries themselves
                redeliveries = int(headers["x-delivery-count"])
                attempts += redeliveries
                suspect = suspect or redeliveries > 0
            activate_at = float(headers.get(ACTIVATE_HEADER, now))
            job_id = message.properties.get("message_id") or f"amqp-{tag}"
            body = message.body if isinstance(message.body, bytes) else message.body.encode()
            if (not isfinite(activate_at) or not (job_id.isascii() or _is_clean(job_id))
                    or (state.undecodable and tag in state.undecodable)):
                raise ValueError(state.undecodable.get(tag) or "unreadable id or activation")
            # Positional: this runs once per job.
            return Delivery(job_id, body, attempts, activate_at, now, message.content_type or "",
                            (self._generation, tag), suspect)
        except Exception as exc:  # anything a producer can send: never kill the slot
            return _malformed_delivery(message, exc, (self._generation, tag), now,
                                       state.undecodable.pop(tag, ""))

    def settle(self, queue: str, settlement: Settlement) -> None:
        if len(settlement):
            self._retrying(lambda: self._settle(queue, settlement))

    def _settle(self, queue: str, settlement: Settlement) -> None:
        state = self._consumers.get(queue)

        def live(delivery: Delivery) -> bool:
            # A delivery from before a reconnect is no longer ours: the broker gives
            # it out again, so republishing it would only duplicate it.
            generation, tag = delivery.receipt
            return state is not None and generation == self._generation and tag in state.held

        by_delay: dict[float, list[tuple[str, bytes, dict[str, Any]]]] = {}
        for delivery, delay_s in settlement.postpone:
            if live(delivery):
                # Same whole-second delay, same ladder route: one confirmed publish round.
                by_delay.setdefault(math.ceil(delay_s), []).append(
                    (delivery.id, delivery.body, {ATTEMPTS_HEADER: delivery.attempts})
                )
        released = [d for d in settlement.release if live(d)]
        if released:
            # Unstarted: the copy records the takes before this one, as the original did.
            by_delay.setdefault(0, []).extend(
                (d.id, d.body, _released_headers(d)) for d in released
            )
        for delay_s, items in by_delay.items():
            self._send(queue, items, delay_s)
        dead = [
            (d.id, d.body, {ATTEMPTS_HEADER: d.attempts, REASON_HEADER: reason[:4000],
                            DEAD_AT_HEADER: time.time()})
            for d, reason in settlement.dead if live(d)
        ]
        if dead:
            self._send(queue, dead, 0.0, to_dead=True)
        done = [d for d in settlement.ack if live(d)]
        done += [d for d, _ in settlement.postpone if live(d)]
        done += [d for d, _ in settlement.dead if live(d)]
        done += released
        if state is not None and done:
            self._ack(state, {d.receipt[1] for d in done})

    @staticmethod
    def _ack(state: _Consumer, tags: set[int]) -> None:
        last = max(tags)
        if all(tag in tags for tag in state.unacked() if tag <= last):
            state.channel.basic_ack(last, multiple=True)
        else:
            for tag in sorted(tags):
                state.channel.basic_ack(tag)
        for tag in tags:
            state.held.pop(tag, None)
        if not state.held:
            state.takes.clear()  # every take settled: nothing left to expire

    # --- inspecting -----------------------------------------------------------

    def _inspector(self) -> Any:
        if self._inspect is None:
            self._inspect = self.conn.channel()
        return self._inspect

    def _count(self, name: str) -> int:
        """Ready messages in queue ``name``; 0 when it does not exist."""
        try:
            return int(self._inspector().queue_declare(name, passive=True).message_count)
        except amqp.exceptions.NotFound:
            self._inspect = None  # the broker closed the channel
            return 0

    def _delayed(self, queue: str) -> int:
        prefix = ladder_prefix(queue)
        if not self._count_exists(ndd.level_name(0, prefix)):
            return 0
        return sum(self._count(ndd.level_name(level, prefix)) for level in range(TOP_LEVEL + 1))

    def _count_exists(self, name: str) -> bool:
        try:
            self._inspector().queue_declare(name, passive=True)
            return True
        except amqp.exceptions.NotFound:
            self._inspect = None
            return False

    def stats(self, queue: str) -> QueueStats:
        check_queue_name(queue)

        def read() -> QueueStats:
            state = self._consumers.get(queue)
            locked = len(state.unacked()) if state else 0
            return QueueStats(
                ready=self._count(queue), locked=locked, delayed=self._delayed(queue),
                dead=self._count(dead_queue_name(queue)),
            )

        return self._retrying(read)

    def queues(self) -> list[str]:
        """Queues this process used: AMQP cannot list a broker's queues."""
        return sorted(self._seen)

    def _get_all(self, channel: Any, name: str, limit: int) -> list[Any]:
        messages: list[Any] = []
        while len(messages) < limit:
            message = channel.basic_get(name, no_ack=False)
            if message is None:
                break
            messages.append(message)
        return messages

    def dead_jobs(self, queue: str, *, limit: int = 100) -> list[DeadJob]:
        """Peeks with basic_get and gives every message back by closing the channel."""
        check_queue_name(queue)

        def peek() -> list[DeadJob]:
            self._declare(queue)
            channel = self.conn.channel()
            try:
                messages = self._get_all(channel, dead_queue_name(queue), DEAD_SCAN_LIMIT)
            finally:
                channel.close()  # unacked: the broker puts them back, in order
            return [_dead_job(queue, m) for m in reversed(messages[-limit:])] if limit else []

        return self._retrying(peek)

    def requeue_dead(self, queue: str) -> int:
        check_queue_name(queue)

        def move() -> int:
            self._declare(queue)
            channel = self.conn.channel()
            moved = 0
            try:
                while batch := self._get_all(channel, dead_queue_name(queue), 500):
                    items: list[tuple[str, bytes, dict[str, Any]]] = [
                        (_printable(m.properties.get("message_id") or ""), _body(m), {})
                        for m in batch
                    ]
                    self._send(queue, items, 0.0)  # confirmed before the ack below
                    channel.basic_ack(batch[-1].delivery_tag, multiple=True)
                    moved += len(batch)
            finally:
                channel.close()
            return moved

        return self._retrying(move)

    def purge(self, queue: str) -> int:
        check_queue_name(queue)

        def purge() -> int:
            self._declare(queue)
            channel = self._inspector()
            count = int(channel.queue_purge(queue) or 0)
            prefix = ladder_prefix(queue)
            if self._count_exists(ndd.level_name(0, prefix)):
                channel = self._inspector()
                for level in range(TOP_LEVEL + 1):
                    count += int(channel.queue_purge(ndd.level_name(level, prefix)) or 0)
            return count

        return self._retrying(purge)

    def delete_queue(self, queue: str) -> None:
        """Remove the queue, its dead-letter queue and its delay ladder (tests; loses jobs)."""

        def delete() -> None:
            state = self._consumers.pop(queue, None)
            if state is not None:
                state.channel.close()  # our own consumer first: no Basic.cancel from the broker
            channel = self._inspector()
            prefix = ladder_prefix(queue)
            for name in (queue, dead_queue_name(queue)):
                channel.queue_delete(name)
            for level in range(TOP_LEVEL + 1):
                channel.queue_delete(ndd.level_name(level, prefix))
                channel.exchange_delete(ndd.level_name(level, prefix))
            channel.exchange_delete(f"{prefix}_{ndd.CELERY_DELAYED_DELIVERY_EXCHANGE}")
            channel.exchange_delete(queue_exchange(queue).name)
            self._forget_topology(queue)
            if self._active == queue:
                self._active = None

        self._retrying(delete)

    def ping(self) -> None:
        self._retrying(lambda: None)

    def close(self) -> None:
        self._closed.set()  # stops the heartbeat thread
        self._closed, self._beats = threading.Event(), None
        try:
            self.conn.release()
        except Exception:  # closing a broken connection: nothing left to release
            logger.debug("closing the RabbitMQ connection failed", exc_info=True)
        self._reset()


def _uncounted_redelivery(message: Any) -> bool:
    """Redelivered after a consumer died, on a queue that does not count deliveries."""
    headers = message.headers or {}
    return bool(message.delivery_info.get("redelivered")) and "x-delivery-count" not in headers


def _released_headers(delivery: Delivery) -> dict[str, Any]:
    """Headers of the copy of an unstarted job: its takes before this one, as before."""
    headers: dict[str, Any] = {ATTEMPTS_HEADER: max(delivery.attempts - 1, 0),
                               ACTIVATE_HEADER: delivery.activate_at}
    if delivery.suspect:
        headers[SUSPECT_HEADER] = 1
    return headers


def _whole(value: Any) -> int | None:
    """A header's whole number, or None when it is not one."""
    if isinstance(value, bool):
        return None
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if number >= 0 else None


def _is_clean(text: str) -> bool:
    """Valid Unicode text: py-amqp decodes an invalid UTF-8 string with escapes
    (see :mod:`qcluster.broker.amqp_readahead`) instead of failing the whole read."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _printable(value: Any) -> str:
    """``value`` as clean text: invalid bytes (escaped by the reader) become U+FFFD."""
    text = value if isinstance(value, str) else str(value)
    if _is_clean(text):
        return text
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _malformed_delivery(
    message: Any, exc: BaseException, receipt: tuple[int, int], now: float, why: str
) -> Delivery:
    """A delivery the slot dead-letters without running: the message's properties or
    headers could not be read (the reason says which)."""
    properties = getattr(message, "properties", None) or {}
    raw_id = properties.get("message_id") or f"amqp-{receipt[1]}"
    body = getattr(message, "body", b"")
    return Delivery(
        id=_printable(raw_id)[:200],
        body=body if isinstance(body, bytes) else _printable(body).encode(),
        attempts=1, activate_at=now, taken_at=now, content_type=JSON_CONTENT_TYPE,
        receipt=receipt,
        malformed=why or _printable(f"malformed: {_what_is_wrong(message, exc)}")[:1000],
    )


def _what_is_wrong(message: Any, exc: BaseException) -> str:
    headers = getattr(message, "headers", None) or {}
    for name, check in ((ATTEMPTS_HEADER, _whole), ("x-delivery-count", _whole),
                        (ACTIVATE_HEADER, _finite)):
        if name in headers and check(headers[name]) is None:
            return f"header {name}={headers[name]!r} is not a valid value"
    message_id = (getattr(message, "properties", None) or {}).get("message_id")
    if isinstance(message_id, str) and not _is_clean(message_id):
        return "message_id is not valid UTF-8"
    return f"{type(exc).__name__}: {exc}"


def _finite(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None


def _body(message: Any) -> bytes:
    body = message.body
    return body if isinstance(body, bytes) else _printable(body).encode()


def _dead_job(queue: str, message: Any) -> DeadJob:
    headers = message.properties.get("application_headers") or {}
    reason = headers.get(REASON_HEADER, "")
    return DeadJob(
        id=_printable(message.properties.get("message_id") or ""),
        queue=queue,
        body=_body(message).decode("utf-8", "replace"),
        reason=reason.decode("utf-8", "replace") if isinstance(reason, bytes)
        else _printable(reason),
        attempts=_whole(headers.get(ATTEMPTS_HEADER, 0)) or 0,
        dead_at=_finite(headers.get(DEAD_AT_HEADER, 0.0)) or 0.0,
    )
