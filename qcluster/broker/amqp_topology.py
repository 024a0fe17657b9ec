"""The RabbitMQ backend's topology: each queue's exchange, its dead-letter store and its
delay ladder, with their names, declared once per connection (again after someone
deleted them)."""

from __future__ import annotations

import logging
from typing import Any, cast

import amqp
from kombu import Exchange, Queue
from kombu.transport import native_delayed_delivery as ndd

from qcluster.broker.amqp_link import AmqpLink
from qcluster.broker.amqp_readahead import Connection
from qcluster.broker.base import DeadRetention

logger = logging.getLogger("qcluster.broker.kombu_broker")

#: The ladder's top level; kombu publishes every delayed message there.
TOP_LEVEL = ndd.MAX_LEVEL
#: (queue, retention) pairs whose store was found declared otherwise: warned once.
_warned_stores: set[tuple[str, DeadRetention]] = set()


def ladder_prefix(queue: str) -> str:
    return f"qc~delay.{queue}"


def queue_exchange(queue: str) -> Exchange:
    return Exchange(f"qc.q.{queue}", type="topic", durable=True)


def dead_queue_name(queue: str) -> str:
    return f"qc~dead.{queue}"


def legacy_dead_queue_name(queue: str) -> str:
    """Where earlier versions kept dead letters (a queue could have that name)."""
    return f"{queue}.dead"


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



class Topology(AmqpLink):
    """Declares queues, dead-letter stores and delay ladders (once per connection)."""

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url, **options)
        self._declared: set[str] = set()
        self._dead_declared: set[str] = set()
        self._laddered: set[str] = set()
        self._seen: set[str] = set()

    def _reset(self) -> None:
        self._declared.clear()
        self._dead_declared.clear()
        self._laddered.clear()
        super()._reset()

    def _declare(self, queue: str) -> None:
        if queue in self._declared:
            return
        channel = self._inspector()
        Queue(queue, queue_exchange(queue), routing_key=queue, durable=True).bind(
            channel
        ).declare()
        self._declared.add(queue)
        self._seen.add(queue)

    def _declare_dead(self, queue: str, retention: DeadRetention) -> None:
        """The queue's dead-letter store, declared at its first dead letter (by a slot,
        which knows the queue's retention): RabbitMQ drops the oldest letter past
        ``x-max-length`` and any letter past ``x-message-ttl``. A store that exists with
        other arguments is used as it is (RabbitMQ cannot change them), with a warning."""
        if queue in self._dead_declared:
            return
        name = dead_queue_name(queue)
        arguments = {"x-max-length": retention.max_count, "x-overflow": "drop-head",
                     "x-message-ttl": retention.max_age_ms}
        try:
            Queue(name, durable=True, queue_arguments=arguments).bind(
                self._inspector()).declare()
        except amqp.exceptions.PreconditionFailed as exc:
            self._inspect = None  # the broker closed the channel
            self._inspector().queue_declare(name, passive=True)
            if (queue, retention) not in _warned_stores:
                _warned_stores.add((queue, retention))
                logger.warning(
                    "RabbitMQ at %s: the dead-letter store %s exists with other arguments "
                    "than dead_max_count=%d, dead_max_age=%gs (%s): it keeps the limits it "
                    "was declared with; a shorter dead_max_age still applies to new dead "
                    "letters. See docs/operations.md, 'Dead-letter retention'.",
                    self.safe_url, name, retention.max_count, retention.max_age_s,
                    getattr(exc, "reply_text", exc))
        self._dead_declared.add(queue)

    def _dead_store_exists(self, queue: str) -> bool:
        return self._count_exists(dead_queue_name(queue))

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
        self._dead_declared.discard(queue)
        self._laddered.discard(queue)
