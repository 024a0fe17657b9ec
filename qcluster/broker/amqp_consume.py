"""The RabbitMQ backend's consumers: one consumer per queue on its own channel, takes
from its buffer, read-ahead, suspect jobs alone, leaving a queue, lock expiry, and acks
(:class:`Consumers`, each queue's state a :class:`QueueConsumer`)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from math import isfinite
from typing import Any

import amqp
from kombu import Consumer, Queue

from qcluster.broker.amqp_link import MAX_BLOCK_S, AmqpLink
from qcluster.broker.amqp_messages import (
    ACTIVATE_HEADER,
    ATTEMPTS_HEADER,
    SUSPECT_HEADER,
    charge_redelivery,
    fold_delivery_count,
    is_clean,
    malformed_delivery,
    message_body,
    taken_attempts,
    uncounted_redelivery,
)
from qcluster.broker.amqp_publish import Publisher
from qcluster.broker.amqp_topology import Topology, queue_exchange
from qcluster.job import JSON_CONTENT_TYPE, Delivery

#: After the first message of a batch arrived, how long to wait for the rest of it.
BATCH_FILL_S = 0.005
#: Before a quorum queue's consumer is cancelled, how long the link must be quiet to
#: conclude the queue sends nothing more to it (see Consumers._cancel).
QUORUM_QUIET_S = 0.05


@dataclass
class QueueConsumer:
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
    extra: list[Consumer] = field(default_factory=list)
    """A quorum queue's consumers added to grow the prefetch (never cancelled to grow)."""
    alone: bool = False
    """A suspect job was handed out alone: take one job at a time, with a prefetch of one,
    until a take brings a job that is not suspect. A dead connection returns every job it
    held suspect; taking a full batch of them to hand out one and give back the rest cost
    a republish of the rest per job (quadratic in the jobs held)."""

    def unacked(self) -> set[int]:
        return set(self.held) | {m.delivery_tag for m in self.buffer}

    def on_decode_error(self, message: Any, exc: BaseException) -> None:
        self.undecodable[message.delivery_tag] = f"malformed: {type(exc).__name__}: {exc}"
        self.buffer.append(message)



class Consumers:
    """Takes through one consumer per queue; acks. Holds every queue's
    :class:`QueueConsumer` and the queue last taken from."""

    def __init__(self, link: AmqpLink, topology: Topology, publisher: Publisher) -> None:
        self.link = link
        self.topology = topology
        self.publisher = publisher
        self._by_queue: dict[str, QueueConsumer] = {}
        self._active: str | None = None
        """The queue last taken from: taking from another one leaves it."""

    def reset(self) -> None:
        """The connection was lost: its channels and their deliveries are gone (the
        broker hands the unacked ones out again)."""
        self._by_queue.clear()
        self._active = None

    def get(self, queue: str) -> QueueConsumer | None:
        return self._by_queue.get(queue)

    def locked(self, queue: str) -> int:
        """Jobs of ``queue`` this process holds unacked (handed out or read ahead)."""
        state = self._by_queue.get(queue)
        return len(state.unacked()) if state else 0

    def forget(self, queue: str) -> None:
        """The queue is being deleted: close its consumer's channel (no Basic.cancel
        comes from the broker then) and forget it."""
        state = self._by_queue.pop(queue, None)
        if state is not None:
            state.channel.close()
        if self._active == queue:
            self._active = None

    def _consumer(self, queue: str, room: int, ahead: int = 0) -> QueueConsumer:
        """The queue's consumer, with a prefetch allowing ``room`` more jobs than held,
        plus ``ahead`` delivered in advance for the next take."""
        self.topology.declare(queue)
        current = self._by_queue.get(queue)
        exact = len(current.held) + room if current else room
        wanted = exact + ahead
        if (current and current.consumer is not None and current.prefetch >= wanted
                and (ahead or current.prefetch <= exact)):
            return current
        if current and current.consumer is not None and self.topology.queue_type(queue) == "quorum":
            # Cancelling would charge an attempt to jobs on their way (see _cancel): a
            # second consumer on the channel adds the credit; a larger prefetch is kept.
            if current.prefetch < wanted:
                current.extra.append(self._start(queue, current, wanted - current.prefetch))
                current.prefetch = wanted
            return current
        if current:
            # A consumer's prefetch is fixed when it starts: restart it with the new one.
            # Messages already delivered stay unacked (locked) on this channel.
            if current.consumer is not None:
                self._cancel(queue, current)
            state = current
        else:
            state = QueueConsumer(channel=self.link.conn.channel(), consumer=None, prefetch=0)
        state.consumer, state.prefetch = self._start(queue, state, wanted), wanted
        self._by_queue[queue] = state
        return state

    @staticmethod
    def _start(queue: str, state: QueueConsumer, prefetch: int) -> Consumer:
        """A consumer of ``queue`` on the state's channel, delivering into its buffer."""
        consumer = Consumer(
            state.channel, queues=[Queue(queue, queue_exchange(queue), routing_key=queue,
                                         durable=True)],
            accept=[JSON_CONTENT_TYPE], on_message=state.buffer.append, auto_declare=False,
            on_decode_error=state.on_decode_error,
        )
        consumer.qos(prefetch_count=prefetch)
        consumer.consume()
        return consumer

    def take(
        self, queue: str, max_jobs: int, wait_s: float, lock_timeout_s: float, ahead: int = 0
    ) -> list[Delivery]:
        """Up to ``max_jobs`` deliveries of ``queue``, waiting up to ``wait_s`` for the
        first; ``ahead`` more are read ahead for the next take (``Broker.take``). Call
        inside the link's ``retrying``."""
        if queue != self._active:
            self._leave_others(queue)
        if any(state.held for state in self._by_queue.values()):
            self._expire_locks()
        known = self._by_queue.get(queue)
        if known is not None and known.alone:
            max_jobs, ahead = 1, 0
        state = self._consumer(queue, max_jobs, ahead)
        if not state.buffer and wait_s <= 0:
            # What the broker already sent (a take that found a full batch in the buffer
            # read nothing more): only an empty link costs the round trip of a count.
            self.link.drain(0.0, every_buffered=True)
            if not state.buffer and self.link.count(queue) > 0:
                wait_s = 2.0  # ready jobs are on their way: --burst must not stop early
        deadline = time.monotonic() + max(wait_s, BATCH_FILL_S)
        while True:
            while not state.buffer:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                self.link.drain(min(remaining, MAX_BLOCK_S), every_buffered=True)
            # The broker streams the batch in: collect what arrives right behind the first.
            while (len(state.buffer) < max_jobs
                   and self.link.drain(BATCH_FILL_S, every_buffered=True)):
                pass
            now, epoch = time.time(), self.link.epoch
            messages: list[Any] = []
            out: list[Delivery] = []
            redelivered: list[Any] = []
            suspect: int | None = None
            buffer, held = state.buffer, state.held
            while buffer and len(out) < max_jobs:
                message = buffer.popleft()
                if uncounted_redelivery(message):
                    redelivered.append(message)
                    continue
                delivery = self._delivery(state, message, now, epoch)
                if delivery.suspect and suspect is None:
                    suspect = len(out)
                held[message.delivery_tag] = delivery
                messages.append(message)
                out.append(delivery)
            if redelivered:
                self._give_back_raw(queue, state, redelivered)
            if suspect is not None:
                out = self._hold_one_suspect(queue, state, out, messages, suspect)
            elif out:
                state.alone = False
            if out:
                state.takes.append((time.monotonic() + lock_timeout_s, out))
                return out

    def _hold_one_suspect(
        self, queue: str, state: QueueConsumer, out: list[Delivery], messages: list[Any],
        index: int,
    ) -> list[Delivery]:
        """Hand out the suspect job alone and hold nothing else while it runs: the
        consumer is stopped (the next take starts it again; even at a prefetch of one, the
        job may have come from a consumer restarted since, whose credit would let one more
        in) and the rest of the take and of the read-ahead go back unchanged. If the job
        kills its slot again, only it is redelivered and charged, not whatever else the slot
        had prefetched. The next takes are of one job until one is not suspect
        (``QueueConsumer.alone``)."""
        if state.consumer is not None:
            self._cancel(queue, state)
        state.alone = True
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
        for other, state in list(self._by_queue.items()):
            if other != queue:
                self._leave(other, state)
        self._active = queue

    def leave(self, queue: str) -> None:
        """Cancel the queue's consumer and give its read-ahead deliveries back, not
        charged; jobs handed out and not settled stay locked until settled or expired.
        Call inside the link's ``retrying`` when the queue has a consumer."""
        state = self._by_queue.get(queue)
        if state is not None:
            self._leave(queue, state)
        if self._active == queue:
            self._active = None

    def _leave(self, queue: str, state: QueueConsumer) -> None:
        if state.consumer is not None:
            self._cancel(queue, state)
        if state.buffer:
            messages = list(state.buffer)
            self._give_back_raw(queue, state, messages)
            state.buffer.clear()
        if not state.held:
            self._by_queue.pop(queue, None)
            state.channel.close()

    def _cancel(self, queue: str, state: QueueConsumer) -> None:
        """Stop the queue's consumers (each waits for cancel-ok: every delivery of a
        classic queue is in the buffer). A quorum queue (RabbitMQ 3.10) keeps back the
        messages it had already assigned to a consumer and returns them later counted as a
        redelivery, so it is cancelled only to leave the queue or to run a suspect job
        alone, and only once its credit is used up: what the queue assigned is received
        first, unless the link stays quiet (the queue ran dry). See docs/operations.md,
        'Quorum queues'."""
        if state.consumer is not None and self.topology.queue_type(queue) == "quorum":
            while (len(state.unacked()) < state.prefetch
                   and self.link.drain(QUORUM_QUIET_S, every_buffered=True)):
                pass
        for consumer in (state.consumer, *state.extra):
            if consumer is not None:
                consumer.cancel()
        state.consumer = None
        state.extra.clear()

    def _expire_locks(self) -> None:
        """Give back, counted and suspect, the jobs taken more than their lock_timeout
        ago and never settled (``on_error="lock"``): RabbitMQ has no lock timeout."""
        now = time.monotonic()
        for queue, state in list(self._by_queue.items()):
            expired: list[Delivery] = []
            while state.takes and state.takes[0][0] <= now:
                _, deliveries = state.takes.popleft()
                expired += [d for d in deliveries if d.receipt[1] in state.held]
            if not state.held:
                state.takes.clear()  # every take settled: nothing can expire
            if expired:
                items = [(d.id, d.body, {ATTEMPTS_HEADER: d.attempts, SUSPECT_HEADER: 1,
                                         ACTIVATE_HEADER: d.activate_at}) for d in expired]
                self.publisher.send(queue, items, 0.0)
                self.ack(state, {d.receipt[1] for d in expired})
                if state.consumer is None and not state.held:
                    self._by_queue.pop(queue, None)
                    state.channel.close()

    def _give_back_raw(self, queue: str, state: QueueConsumer, messages: list[Any]) -> None:
        """Republish delivered messages, then ack them: unchanged when they were never
        handed out (no attempt charged); suspect when the broker redelivered them (the
        consumer that had them died), charged an attempt only if they were suspect
        already (amqp_messages.charged: a suspect job ran alone, so the death was its
        own; any other held job may not have run at all). Confirmed before the ack: a
        crash in between duplicates, never loses.

        Classic queues only flag a redelivery; without counting it a job whose slot dies
        every time (a poison job) would never reach max_attempts.
        """
        copies = []
        for message in messages:
            properties = dict(message.properties)
            headers = dict(properties.get("application_headers") or {})
            if uncounted_redelivery(message):
                charge_redelivery(headers, 1)
                headers.setdefault(ACTIVATE_HEADER, time.time())
            fold_delivery_count(headers)  # a quorum queue's count, neither lost nor doubled
            properties["application_headers"] = headers
            properties["delivery_mode"] = 2
            copies.append(amqp.Message(message_body(message), **properties))
            state.undecodable.pop(message.delivery_tag, None)
        self.publisher.publish(queue, copies)
        for message in messages:
            state.channel.basic_ack(message.delivery_tag)

    @staticmethod
    def _delivery(state: QueueConsumer, message: Any, now: float, epoch: int) -> Delivery:
        tag = message.delivery_tag
        try:
            headers = message.headers or {}
            attempts, suspect = taken_attempts(headers)
            activate_at = float(headers.get(ACTIVATE_HEADER, now))
            job_id = message.properties.get("message_id") or f"amqp-{tag}"
            body = message.body if isinstance(message.body, bytes) else message.body.encode()
            if (not isfinite(activate_at) or not (job_id.isascii() or is_clean(job_id))
                    or (state.undecodable and tag in state.undecodable)):
                raise ValueError(state.undecodable.get(tag) or "unreadable id or activation")
            # Positional: this runs once per job.
            return Delivery(job_id, body, attempts, activate_at, now, message.content_type or "",
                            (epoch, tag), suspect)
        except Exception as exc:  # anything a producer can send: never kill the slot
            return malformed_delivery(message, exc, (epoch, tag), now,
                                      state.undecodable.pop(tag, ""))

    @staticmethod
    def ack(state: QueueConsumer, tags: set[int]) -> None:
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
