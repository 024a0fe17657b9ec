"""The RabbitMQ backend's publishing: mandatory publishes with publisher confirms, many in
flight at once, declaring the queue again when the broker returned a message."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

import amqp
from kombu.transport import native_delayed_delivery as ndd

from qcluster.broker.amqp_link import MAX_BLOCK_S
from qcluster.broker.amqp_messages import ACTIVATE_HEADER
from qcluster.broker.amqp_topology import (
    TOP_LEVEL,
    Topology,
    dead_queue_name,
    ladder_prefix,
    queue_exchange,
)
from qcluster.broker.base import DeadRetention
from qcluster.errors import BrokerError, BrokerUnavailable
from qcluster.job import JSON_CONTENT_TYPE
from qcluster.names import check_queue_name

logger = logging.getLogger("qcluster.broker.kombu_broker")


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
        # Confirms are tracked here, many in flight at once: the connection is opened
        # without kombu's confirm_publish option, which makes basic_publish wait for each.
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



class Publishing(Topology):
    """Publishes through one confirmed channel."""

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url, **options)
        self._pub: Any = None
        self._confirms: _Confirms | None = None

    def _reset(self) -> None:
        self._pub = self._confirms = None
        super()._reset()

    def _publisher(self) -> tuple[Any, _Confirms]:
        if self._pub is None or self._confirms is None:
            self._pub = self.conn.channel()
            self._confirms = _Confirms(self._pub)
        return self._pub, self._confirms

    def _send(
        self, queue: str, items: Iterable[tuple[str, bytes, dict[str, Any]]], delay_s: float,
        *, dead: DeadRetention | None = None,
    ) -> None:
        """Publish ``(job_id, body, headers)`` and wait for every publisher confirm; with
        ``dead``, to the dead-letter store, each letter expiring after its max age."""
        countdown = math.ceil(delay_s) if delay_s > 0 else 0
        activate_at = time.time() + countdown
        extra = {"expiration": str(dead.max_age_ms)} if dead else {}
        messages = [
            amqp.Message(
                body, content_type=JSON_CONTENT_TYPE, delivery_mode=2, message_id=job_id,
                application_headers={ACTIVATE_HEADER: activate_at, **headers}, **extra,
            )
            for job_id, body, headers in items
        ]
        self._publish(queue, messages, countdown, dead=dead)

    def _publish(
        self, queue: str, messages: list[Any], countdown: int = 0, *,
        dead: DeadRetention | None = None,
    ) -> None:
        """Publish ``messages`` (mandatory, confirmed). One more round after the broker
        returned some (no queue took them) or did not know the exchange: the queue was
        deleted behind our back, so it is declared again. Raises if that fails too."""
        try:
            returned = self._publish_once(queue, messages, countdown, dead)
        except amqp.exceptions.NotFound as exc:
            logger.warning("RabbitMQ at %s: %s; declaring %s again", self.safe_url, exc, queue)
            self._pub = self._confirms = self._inspect = None  # the broker closed them
            self._forget_topology(queue)
            returned = self._publish_once(queue, messages, countdown, dead)
        if returned:
            logger.warning("RabbitMQ at %s: %d message(s) for %s unroutable; declaring it "
                           "again", self.safe_url, len(returned), queue)
            self._forget_topology(queue)
            if self._publish_once(queue, returned, countdown, dead):
                raise BrokerError(
                    f"RabbitMQ at {self.safe_url}: no queue took messages for {queue!r}"
                )

    def _publish_once(
        self, queue: str, messages: list[Any], countdown: int, dead: DeadRetention | None
    ) -> list[Any]:
        """Publish and wait for every confirm; returns the messages the broker returned."""
        self._declare(queue)
        if dead:
            self._declare_dead(queue, dead)
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
            channel.basic_publish(message, exchange=exchange, routing_key=routing_key,
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
    ) -> list[str]:
        """Every message is stored and returned as new: AMQP cannot look an id up in a
        queue (base.Broker.publish_many)."""
        check_queue_name(queue)
        items: list[tuple[str, bytes, dict[str, Any]]] = [
            (job_id, body, {}) for job_id, body in messages
        ]
        self._retrying(lambda: self._send(queue, items, delay_s))
        return list(dict.fromkeys(job_id for job_id, _ in messages))
