"""The RabbitMQ backend's publisher: mandatory publishes with publisher confirms, many in
flight at once, declaring the queue again when the broker returned a message."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from typing import Any

import amqp
from kombu.transport import native_delayed_delivery as ndd

from qcluster.broker.amqp_link import MAX_BLOCK_S, AmqpLink
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

logger = logging.getLogger(__name__)

#: What a short-lived caller that gave up on a blocked broker is told to do.
BLOCKED_HINT = ("free memory or disk on it (its log names the alarm), then publish again; "
                "'rabbitmq-diagnostics alarms' lists them")


class Confirms:
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



class Publisher:
    """Publishes through one confirmed channel (opened when first needed)."""

    def __init__(self, link: AmqpLink, topology: Topology) -> None:
        self.link = link
        self.topology = topology
        self._channel: Any = None
        self._confirms: Confirms | None = None

    def reset(self) -> None:
        """The connection was lost (or the broker closed the channel): open another."""
        self._channel = self._confirms = None

    def confirmed_channel(self) -> tuple[Any, Confirms]:
        """The publishing channel and its confirms."""
        if self._channel is None or self._confirms is None:
            self._channel = self.link.conn.channel()
            self._confirms = Confirms(self._channel)
        return self._channel, self._confirms

    def send(
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
        self.publish(queue, messages, countdown, dead=dead)

    def publish(
        self, queue: str, messages: list[Any], countdown: int = 0, *,
        dead: DeadRetention | None = None,
    ) -> None:
        """Publish ``messages`` (mandatory, confirmed). One more round after the broker
        returned some (no queue took them) or did not know the exchange: the queue was
        deleted behind our back, so it is declared again. Raises if that fails too."""
        self.refuse_when_blocked()
        try:
            returned = self._publish_once(queue, messages, countdown, dead)
        except amqp.exceptions.NotFound as exc:
            logger.warning("RabbitMQ at %s: %s; declaring %s again", self.link.safe_url, exc,
                           queue)
            self.reset()  # the broker closed both channels
            self.link.inspector_closed()
            self.topology.forget(queue)
            returned = self._publish_once(queue, messages, countdown, dead)
        if returned:
            logger.warning("RabbitMQ at %s: %d message(s) for %s unroutable; declaring it "
                           "again", self.link.safe_url, len(returned), queue)
            self.topology.forget(queue)
            if self._publish_once(queue, returned, countdown, dead):
                raise BrokerError(
                    f"RabbitMQ at {self.link.safe_url}: no queue took messages for {queue!r}"
                )

    def _blocks_publishers(self, *, sent: bool) -> str:
        """Why a short-lived caller gave up on a broker that blocks publishing, in one
        line. Nothing was enqueued only when nothing was written since it blocked
        (``sent`` False); a message written before may still be stored once it unblocks."""
        said = f"RabbitMQ at {self.link.safe_url} blocks publishers (its memory or disk alarm)"
        if not sent:
            return f"{said}: nothing was enqueued; {BLOCKED_HINT}"
        return (f"{said}: what was sent may or may not be stored once it unblocks (no "
                f"publisher confirm came); {BLOCKED_HINT}")

    def refuse_when_blocked(self) -> None:
        """A short-lived caller (``give_up_s``) writes nothing on a connection the broker
        is known to block: it would wait for a confirm that cannot come (and any request,
        a queue's declare too, hangs while the broker reads nothing from the connection)."""
        if self.link.blocks_short_lived():
            raise BrokerUnavailable(self._blocks_publishers(sent=False))

    def _gave_up_blocked(self) -> bool:
        """A short-lived caller has waited ``give_up_s`` since the broker blocked it."""
        give_up_s, blocked_at = self.link.give_up_s, self.link.blocked_at
        return (give_up_s is not None and blocked_at is not None
                and time.monotonic() >= blocked_at + give_up_s)

    def _no_confirm(self) -> str:
        """Why a publish was not confirmed in time, in one line."""
        said = (f"RabbitMQ at {self.link.safe_url}: no publisher confirm in "
                f"{self.link.confirm_timeout_s:g} s")
        if self.link.blocked_at is None:
            return said
        return (f"{said}: it blocks publishing (a resource alarm, memory or disk: see its "
                "log); the job may still be stored once it unblocks")

    def _publish_once(
        self, queue: str, messages: list[Any], countdown: int, dead: DeadRetention | None
    ) -> list[Any]:
        """Publish and wait for every confirm; returns the messages the broker returned."""
        self.topology.declare(queue)
        if dead:
            self.topology.declare_dead(queue, dead)
            exchange, routing_key = "", dead_queue_name(queue)
        elif countdown:
            self.topology.declare_ladder(queue)
            exchange = ndd.level_name(TOP_LEVEL, ladder_prefix(queue))
            routing_key = ndd.calculate_routing_key(countdown, queue)
        else:
            exchange, routing_key = queue_exchange(queue).name, queue
        channel, confirms = self.confirmed_channel()
        confirms.returned = []
        self.refuse_when_blocked()  # a declare's reply may have come after a block
        for message in messages:
            channel.basic_publish(message, exchange=exchange, routing_key=routing_key,
                                  mandatory=True)
            confirms.published += 1
        deadline = time.monotonic() + self.link.confirm_timeout_s
        while not confirms.all_confirmed():
            if self._gave_up_blocked():
                raise BrokerUnavailable(self._blocks_publishers(sent=True))
            if time.monotonic() > deadline:
                raise BrokerUnavailable(self._no_confirm())
            # A short-lived caller reads in smaller steps, to give up on time once blocked.
            self.link.drain(MAX_BLOCK_S if self.link.give_up_s is None else
                            min(MAX_BLOCK_S, self.link.give_up_s / 4))
        return confirms.returned
