"""The RabbitMQ backend's consuming: one consumer per queue on its own channel, takes
from its buffer, read-ahead, suspect jobs alone, leaving a queue, lock expiry, and acks."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from math import isfinite
from typing import Any

import amqp
from kombu import Consumer, Queue

from qcluster.broker.amqp_link import MAX_BLOCK_S
from qcluster.broker.amqp_messages import (
    ACTIVATE_HEADER,
    ATTEMPTS_HEADER,
    SUSPECT_HEADER,
    _body,
    _charge_redelivery,
    _fold_delivery_count,
    _is_clean,
    _malformed_delivery,
    _taken_attempts,
    _uncounted_redelivery,
)
from qcluster.broker.amqp_publish import Publishing
from qcluster.broker.amqp_topology import queue_exchange
from qcluster.broker.base import Settlement
from qcluster.job import JSON_CONTENT_TYPE, Delivery
from qcluster.names import check_queue_name

#: After the first message of a batch arrived, how long to wait for the rest of it.
BATCH_FILL_S = 0.005
#: Before a quorum queue's consumer is cancelled, how long the link must be quiet to
#: conclude the queue sends nothing more to it (see Consuming._cancel).
QUORUM_QUIET_S = 0.05


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
    extra: list[Consumer] = field(default_factory=list)
    """A quorum queue's consumers added to grow the prefetch (never cancelled to grow)."""

    def unacked(self) -> set[int]:
        return set(self.held) | {m.delivery_tag for m in self.buffer}

    def on_decode_error(self, message: Any, exc: BaseException) -> None:
        self.undecodable[message.delivery_tag] = f"malformed: {type(exc).__name__}: {exc}"
        self.buffer.append(message)



class Consuming(Publishing):
    """Takes through one consumer per queue; acks."""

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url, **options)
        self._consumers: dict[str, _Consumer] = {}
        self._active: str | None = None
        """The queue last taken from: taking from another one leaves it."""

    def _reset(self) -> None:
        self._consumers.clear()
        self._active = None
        super()._reset()

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
        if current and current.consumer is not None and self.queue_type(queue) == "quorum":
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
            state = _Consumer(channel=self.conn.channel(), consumer=None, prefetch=0)
        state.consumer, state.prefetch = self._start(queue, state, wanted), wanted
        self._consumers[queue] = state
        return state

    @staticmethod
    def _start(queue: str, state: _Consumer, prefetch: int) -> Consumer:
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
            self._cancel(queue, state)
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
            self._cancel(queue, state)
        if state.buffer:
            messages = list(state.buffer)
            self._give_back_raw(queue, state, messages)
            state.buffer.clear()
        if not state.held:
            self._consumers.pop(queue, None)
            state.channel.close()

    def _cancel(self, queue: str, state: _Consumer) -> None:
        """Stop the queue's consumers (each waits for cancel-ok: every delivery of a
        classic queue is in the buffer). A quorum queue (RabbitMQ 3.10) keeps back the
        messages it had already assigned to a consumer and returns them later counted as a
        redelivery, so it is cancelled only to leave the queue or to run a suspect job
        alone, and only once its credit is used up: what the queue assigned is received
        first, unless the link stays quiet (the queue ran dry). See docs/operations.md,
        'Quorum queues'."""
        if state.consumer is not None and self.queue_type(queue) == "quorum":
            while len(state.unacked()) < state.prefetch and self._drain(QUORUM_QUIET_S):
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
        handed out (no attempt charged); suspect when the broker redelivered them (the
        consumer that had them died), charged an attempt only if they were suspect
        already (amqp_messages._charged: a suspect job ran alone, so the death was its
        own; any other held job may not have run at all). Confirmed before the ack: a
        crash in between duplicates, never loses.

        Classic queues only flag a redelivery; without counting it a job whose slot dies
        every time (a poison job) would never reach max_attempts.
        """
        copies = []
        for message in messages:
            properties = dict(message.properties)
            headers = dict(properties.get("application_headers") or {})
            if _uncounted_redelivery(message):
                _charge_redelivery(headers, 1)
                headers.setdefault(ACTIVATE_HEADER, time.time())
            _fold_delivery_count(headers)  # a quorum queue's count, neither lost nor doubled
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
            attempts, suspect = _taken_attempts(headers)
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
