"""The RabbitMQ backend through kombu (``amqp://``, ``pyamqp://``; ``;`` joins failover URLs).

How the queue-server contract maps onto AMQP (README, "Backend semantics"):

- A queue NAME is a durable classic queue bound to its own durable topic exchange
  ``qc.q.NAME``. Its dead-letter store is the durable queue ``NAME.dead``.
- ``take`` is a kombu consumer with ``prefetch_count`` = the batch size and
  ``accept=["application/json"]``: the broker's own unacked state is the lock, so taking
  and locking are one server-side step. A slot whose handler is fast asks for read-ahead
  (``settle_and_take``): prefetch twice the batch, so the next batch streams in while
  this one runs. Frames are read through a read-ahead socket buffer
  (:mod:`qcluster.broker.amqp_readahead`). There is no lock timeout: unacked jobs come back
  when the slot's connection closes (killed, crashed, or its master killed it when hung).
- ``settle`` acks a whole batch with one ``multiple=True`` ack when it can (acks have no
  reply, so settling a done batch costs no round trip); postponed and dead jobs are first
  republished (publisher confirms) and only then acked, so a crash in between duplicates
  a job and never loses one.
- Delays use kombu's native delayed delivery (the TTL + dead-letter ladder of 28 binary
  levels), one ladder per queue (prefix ``qc.NAME``) so that ``stats`` can count the
  queue's delayed jobs. Delays are whole seconds, rounded up.
- Attempts: a header records the takes before this copy of the message; a take adds
  one. A message the broker redelivers (its consumer died) is republished with the
  header incremented and the original acked, so crashes count too (quorum queues'
  ``x-delivery-count`` is used instead when present).
- ``stats``: ready and delayed come from the broker (``queue_declare(passive=True)``);
  AMQP cannot report other consumers' unacked messages, so ``locked`` counts only what
  this process holds.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit, urlunsplit

import amqp
from kombu import Consumer, Exchange, Queue
from kombu.transport import native_delayed_delivery as ndd

from qcluster.broker.amqp_readahead import Connection
from qcluster.broker.base import Broker, DeadJob, QueueStats, Settlement
from qcluster.errors import BrokerError, BrokerUnavailable
from qcluster.job import JSON_CONTENT_TYPE, Delivery

logger = logging.getLogger(__name__)

T = TypeVar("T")

ATTEMPTS_HEADER = "x-qc-attempts"
ACTIVATE_HEADER = "x-qc-activate-at"
REASON_HEADER = "x-qc-reason"
DEAD_AT_HEADER = "x-qc-dead-at"
#: The ladder's top level; kombu publishes every delayed message there.
TOP_LEVEL = ndd.MAX_LEVEL
#: Longest single blocking read, so SIGTERM and master commands are noticed.
MAX_BLOCK_S = 1.0
#: After the first message of a batch arrived, how long to wait for the rest of it.
BATCH_FILL_S = 0.005
#: dead_jobs reads at most this many dead messages to find the newest ones.
DEAD_SCAN_LIMIT = 10_000


def mask_url(url: str) -> str:
    masked = []
    for one in url.split(";"):
        parts = urlsplit(one)
        if parts.password:
            netloc = parts.netloc.replace(f":{parts.password}@", ":**@")
            one = urlunsplit(parts._replace(netloc=netloc))
        masked.append(one)
    return ";".join(masked)


def ladder_prefix(queue: str) -> str:
    return f"qc.{queue}"


def queue_exchange(queue: str) -> Exchange:
    return Exchange(f"qc.q.{queue}", type="topic", durable=True)


def dead_queue_name(queue: str) -> str:
    return f"{queue}.dead"


@dataclass
class _Consumer:
    """One queue's consumer on its own channel: delivery tags (and multiple acks)
    never mix queues."""

    channel: Any
    consumer: Consumer
    prefetch: int
    buffer: deque[Any] = field(default_factory=deque)
    """Delivered by the broker, not yet handed out by take (already unacked/locked)."""
    held: dict[int, Any] = field(default_factory=dict)
    """Handed out by take, not yet settled: delivery tag -> message."""

    def unacked(self) -> set[int]:
        return set(self.held) | {m.delivery_tag for m in self.buffer}


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
            channel.close()


class _Confirms:
    """Publisher confirms for many messages in flight on one channel."""

    def __init__(self, channel: Any) -> None:
        self.published = 0
        self.acked: set[int] = set()
        self.acked_upto = 0
        self.nacked = False
        channel.events["basic_ack"].add(self._on_ack)
        channel.events["basic_nack"].add(self._on_nack)
        channel._confirm_selected = True  # the confirm_publish transport option's flag
        channel.confirm_select()

    def _on_ack(self, tag: int, multiple: bool) -> None:
        if multiple:
            self.acked_upto = max(self.acked_upto, tag)
        else:
            self.acked.add(tag)

    def _on_nack(self, tag: int, multiple: bool) -> None:
        self.nacked = True

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
        connect_timeout_s: float = 5.0,
        confirm_timeout_s: float = 30.0,
    ) -> None:
        self.url = url
        self.safe_url = mask_url(url)
        self.max_retries = max_retries
        self.confirm_timeout_s = confirm_timeout_s
        self.conn = Connection(
            url,
            failover_strategy="round-robin",
            transport_options={"confirm_publish": True},
            connect_timeout=connect_timeout_s,
        )
        self._recoverable: tuple[type[BaseException], ...] = (
            *self.conn.recoverable_connection_errors,
            *self.conn.recoverable_channel_errors,
            OSError,
        )
        self._generation = 0
        self._consumers: dict[str, _Consumer] = {}
        self._declared: set[str] = set()
        self._laddered: set[str] = set()
        self._seen: set[str] = set()
        self._pub: Any = None
        self._confirms: _Confirms | None = None
        self._inspect: Any = None

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

    def _reset(self) -> None:
        """Forget every channel: the broker returns their unacked jobs by itself."""
        self._generation += 1
        self._consumers.clear()
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
        """Process incoming frames for up to ``timeout_s``; False when none came."""
        try:
            self.conn.drain_events(timeout=max(timeout_s, 0.001))
        except TimeoutError:  # socket.timeout is an alias
            return False
        return True

    # --- topology -------------------------------------------------------------

    def _declare(self, queue: str) -> None:
        if queue in self._declared:
            return
        channel = self.conn.default_channel
        Queue(queue, queue_exchange(queue), routing_key=queue, durable=True).bind(
            channel
        ).declare()
        Queue(dead_queue_name(queue), durable=True).bind(channel).declare()
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
        self._declare(queue)
        countdown = math.ceil(delay_s) if delay_s > 0 else 0
        if to_dead:
            exchange, routing_key = "", dead_queue_name(queue)
        elif countdown:
            self._declare_ladder(queue)
            exchange = ndd.level_name(TOP_LEVEL, ladder_prefix(queue))
            routing_key = ndd.calculate_routing_key(countdown, queue)
        else:
            exchange, routing_key = queue_exchange(queue).name, queue
        channel, confirms = self._publisher()
        activate_at = time.time() + countdown
        for job_id, body, headers in items:
            message = amqp.Message(
                body, content_type=JSON_CONTENT_TYPE, delivery_mode=2, message_id=job_id,
                application_headers={ACTIVATE_HEADER: activate_at, **headers},
            )
            channel._basic_publish(message, exchange=exchange, routing_key=routing_key)
            confirms.published += 1
        deadline = time.monotonic() + self.confirm_timeout_s
        while not confirms.all_confirmed():
            if time.monotonic() > deadline:
                raise BrokerUnavailable(f"RabbitMQ at {self.safe_url}: no publisher confirm")
            self._drain(MAX_BLOCK_S)

    def publish_many(
        self, queue: str, messages: Sequence[tuple[str, bytes]], *, delay_s: float = 0.0
    ) -> None:
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
        if current and current.prefetch >= wanted and (ahead or current.prefetch <= exact):
            return current
        if current:
            # A consumer's prefetch is fixed when it starts: restart it with the new one.
            # Messages already delivered stay unacked (locked) on this channel.
            current.consumer.cancel()
            channel, buffer, held = current.channel, current.buffer, current.held
        else:
            channel, buffer, held = self.conn.channel(), deque(), {}
        state = _Consumer(channel=channel, consumer=None, prefetch=wanted,  # type: ignore[arg-type]
                          buffer=buffer, held=held)
        consumer = Consumer(
            channel, queues=[Queue(queue, queue_exchange(queue), routing_key=queue,
                                   durable=True)],
            accept=[JSON_CONTENT_TYPE], on_message=state.buffer.append, auto_declare=False,
        )
        consumer.qos(prefetch_count=wanted)
        consumer.consume()
        state.consumer = consumer
        self._consumers[queue] = state
        return state

    def take(
        self, queue: str, *, max_jobs: int, lock_timeout_s: float, wait_s: float = 0.0
    ) -> list[Delivery]:
        return self._retrying(lambda: self._take(queue, max_jobs, wait_s))

    def settle_and_take(
        self, queue: str, settlement: Settlement, *, max_jobs: int, lock_timeout_s: float,
        wait_s: float = 0.0, read_ahead: bool = False,
    ) -> list[Delivery]:
        """Acks have no reply, so the settle costs nothing; with ``read_ahead`` the next
        batch streams in while this one runs instead of after its ack reached the broker
        (which otherwise leaves both the slot and RabbitMQ idle once per batch)."""
        self.settle(queue, settlement)
        ahead = max_jobs if read_ahead else 0
        return self._retrying(lambda: self._take(queue, max_jobs, wait_s, ahead))

    def _take(self, queue: str, max_jobs: int, wait_s: float, ahead: int = 0) -> list[Delivery]:
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
            out: list[Delivery] = []
            redelivered: list[Any] = []
            while state.buffer and len(out) < max_jobs:
                message = state.buffer.popleft()
                if _uncounted_redelivery(message):
                    redelivered.append(message)
                    continue
                state.held[message.delivery_tag] = message
                out.append(self._delivery(message, now))
            if redelivered:
                self._count_redeliveries(queue, state, redelivered)
            if out:
                return out

    def _count_redeliveries(self, queue: str, state: _Consumer, messages: list[Any]) -> None:
        """Republish redelivered messages with their take recorded, then ack them.

        Classic queues only flag a redelivery; without this a job whose slot dies every
        time (a poison job) would count 2 attempts forever and never reach max_attempts.
        Confirmed before the ack: a crash in between duplicates, never loses.
        """
        items = []
        for message in messages:
            headers = message.headers or {}
            items.append((
                str(message.properties.get("message_id") or ""), _body(message),
                {ATTEMPTS_HEADER: int(headers.get(ATTEMPTS_HEADER, 0)) + 1,
                 ACTIVATE_HEADER: headers.get(ACTIVATE_HEADER, time.time())},
            ))
        self._send(queue, items, 0.0)
        for message in messages:
            state.channel.basic_ack(message.delivery_tag)

    def _delivery(self, message: Any, now: float) -> Delivery:
        headers = message.headers or {}
        attempts = int(headers.get(ATTEMPTS_HEADER, 0)) + 1
        if "x-delivery-count" in headers:  # quorum queues count redeliveries themselves
            attempts += int(headers["x-delivery-count"])
        tag = message.delivery_tag
        return Delivery(
            id=str(message.properties.get("message_id") or f"amqp-{tag}"),
            body=message.body if isinstance(message.body, bytes) else message.body.encode(),
            attempts=attempts,
            activate_at=float(headers.get(ACTIVATE_HEADER, now)),
            taken_at=now,
            content_type=message.content_type or "",
            receipt=(self._generation, tag),
        )

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
        def move() -> int:
            self._declare(queue)
            channel = self.conn.channel()
            moved = 0
            try:
                while batch := self._get_all(channel, dead_queue_name(queue), 500):
                    items: list[tuple[str, bytes, dict[str, Any]]] = [
                        (str(m.properties.get("message_id") or ""), _body(m), {})
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
            self._declared.discard(queue)
            self._laddered.discard(queue)

        self._retrying(delete)

    def ping(self) -> None:
        self._retrying(lambda: None)

    def close(self) -> None:
        try:
            self.conn.release()
        except Exception:  # closing a broken connection: nothing left to release
            logger.debug("closing the RabbitMQ connection failed", exc_info=True)
        self._reset()


def _uncounted_redelivery(message: Any) -> bool:
    """Redelivered after a consumer died, on a queue that does not count deliveries."""
    headers = message.headers or {}
    return bool(message.delivery_info.get("redelivered")) and "x-delivery-count" not in headers


def _body(message: Any) -> bytes:
    body = message.body
    return body if isinstance(body, bytes) else str(body).encode()


def _dead_job(queue: str, message: Any) -> DeadJob:
    headers = message.properties.get("application_headers") or {}
    reason = headers.get(REASON_HEADER, "")
    return DeadJob(
        id=str(message.properties.get("message_id") or ""),
        queue=queue,
        body=_body(message).decode("utf-8", "replace"),
        reason=reason.decode("utf-8", "replace") if isinstance(reason, bytes) else str(reason),
        attempts=int(headers.get(ATTEMPTS_HEADER, 0)),
        dead_at=float(headers.get(DEAD_AT_HEADER, 0.0)),
    )
