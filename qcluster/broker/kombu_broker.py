"""The RabbitMQ backend through kombu (``amqp://``, ``pyamqp://``; ``;`` joins failover URLs).

How the queue-server contract maps onto AMQP (README, "Backend semantics"):

- A queue NAME is a durable classic queue bound to its own durable topic exchange
  ``qc.q.NAME``. Its dead-letter store is the durable queue ``qc~dead.NAME`` and its
  delay ladder is named from ``qc~delay.NAME``: ``~`` is not allowed in a queue name
  (:mod:`qcluster.names`), so no queue can be another queue's store or ladder.
- Dead-letter retention (the queue's ``dead_max_count`` / ``dead_max_age``, passed by the
  slot with each settle) is applied by RabbitMQ: the store is declared at its first dead
  letter with ``x-max-length`` (``drop-head``) and ``x-message-ttl`` from it, and each
  dead letter carries its own ``expiration``, so a shorter age applies to new dead letters
  at once. Queue arguments cannot change: a store that exists with other arguments (the
  count changed, or an earlier version declared it) is used as it is, with a warning
  (docs/operations.md, "Dead-letter retention").
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
  one. A message the broker redelivers (its consumer died) is republished marked
  suspect, and the original acked; the header is incremented only if it was suspect
  already (it ran alone: the death was its own), so no batch-mate is charged for a
  crash and a poison job's crashes after its first count (quorum queues'
  ``x-delivery-count`` the same way, :func:`~qcluster.broker.amqp_messages._charged`).
- A message whose properties or headers cannot be read is handed to the slot marked
  ``malformed`` (the slot dead-letters it); nothing a producer sends stops a slot.
- Heartbeats (``?heartbeat=`` seconds in the URL, default 10) are sent by a small thread
  (so a long batch keeps the link alive) and checked each time frames are read, so a
  dead link ends in a reconnect or a clear error; ``?connect_timeout=`` and
  ``?write_timeout=`` bound connecting and writing.
- Operator controls (the manager's pause and drain, :mod:`qcluster.controls`) are one JSON
  document, ``{"version": N, "controls": {"KIND:NAME": value}}``, the only message of the
  durable queue ``qc~controls`` (``x-max-length`` 1): AMQP cannot list queues, so one place
  holds them all. A reader takes the message unacknowledged and gives it back (closes its
  channel); a writer holds it while it publishes the changed document (confirmed), then
  acks the old one, so two managers' changes do not overwrite each other (a writer that
  dies between the two leaves both: the higher version wins). While another process holds
  it, a reader finds the queue empty and keeps what it read last (``read_controls``: None),
  and a writer refuses (``DocumentHeld``, a BrokerUnavailable; only the call that creates
  the queue writes on an empty one: :mod:`~qcluster.broker.amqp_single`).
- ``stats``: ready and delayed come from the broker (``queue_declare(passive=True)``);
  AMQP cannot report other consumers' unacked messages, so ``locked`` counts only what
  this process holds.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from typing import Any

from kombu.transport import native_delayed_delivery as ndd

from qcluster.broker import amqp_jobs
from qcluster.broker.amqp_consume import BATCH_FILL_S, Consuming
from qcluster.broker.amqp_link import MAX_BLOCK_S, URL_OPTIONS, split_url_options
from qcluster.broker.amqp_messages import (
    ACTIVATE_HEADER,
    ATTEMPTS_HEADER,
    DEAD_AT_HEADER,
    ERROR_HEADER,
    REASON_HEADER,
    SUSPECT_HEADER,
    _body,
    _dead_job,
    _printable,
    _released_headers,
)
from qcluster.broker.amqp_periodic import PeriodicLedger
from qcluster.broker.amqp_single import SingleDocumentQueue
from qcluster.broker.amqp_topology import (
    TOP_LEVEL,
    dead_queue_name,
    ladder_prefix,
    legacy_dead_queue_name,
    queue_exchange,
)
from qcluster.broker.base import DeadJob, DeadRetention, QueueStats, Settlement
from qcluster.job import Delivery
from qcluster.jobs import JobInfo, JobPage
from qcluster.names import check_queue_name
from qcluster.policy import DEFAULT_DEAD_MAX_AGE, DEFAULT_DEAD_MAX_COUNT

__all__ = [
    "ACTIVATE_HEADER", "ATTEMPTS_HEADER", "BATCH_FILL_S", "DEAD_AT_HEADER", "DEAD_SCAN_LIMIT",
    "MAX_BLOCK_S", "REASON_HEADER", "SUSPECT_HEADER", "TOP_LEVEL", "URL_OPTIONS",
    "KombuBroker", "dead_queue_name", "ladder_prefix", "legacy_dead_queue_name",
    "queue_exchange", "split_url_options",
]

#: dead_jobs reads at most this many dead messages to find the newest ones.
DEAD_SCAN_LIMIT = 10_000
#: The operator controls' document: the only message of this queue (see the docstring).
CONTROLS_QUEUE = "qc~controls"
#: A writer that finds the existing queue empty (another process holds the document) looks
#: again this often, this long apart (a reader holds it for a round trip), then refuses
#: (DocumentHeld, a BrokerUnavailable): it never writes on an empty document it did not
#: create (qcluster.broker.amqp_single).
CONTROL_HOLD_TRIES = 20
CONTROL_HOLD_WAIT_S = 0.05


class KombuBroker(Consuming):
    """Queue server on RabbitMQ through kombu (see the module docstring). The layers it
    builds on, each in its own module: the connection (:mod:`~qcluster.broker.amqp_link`),
    topology (:mod:`~qcluster.broker.amqp_topology`), publishing
    (:mod:`~qcluster.broker.amqp_publish`), consuming (:mod:`~qcluster.broker.amqp_consume`);
    here: settling and inspecting."""

    def __init__(
        self,
        url: str,
        *,
        max_retries: int = 5,
        connect_timeout_s: float | None = None,
        confirm_timeout_s: float = 30.0,
        dead_max_count: int = DEFAULT_DEAD_MAX_COUNT,
        dead_max_age_s: float = DEFAULT_DEAD_MAX_AGE,
    ) -> None:
        """``dead_max_count``/``dead_max_age_s``: dead-letter retention for a settle
        whose ``retention`` is None (a slot passes its queue's policy)."""
        self._retention = DeadRetention(dead_max_count, dead_max_age_s)
        super().__init__(url, max_retries=max_retries, connect_timeout_s=connect_timeout_s,
                         confirm_timeout_s=confirm_timeout_s)
        self._periodic = PeriodicLedger(self.conn, confirm_timeout_s)
        """Periodic jobs' lock and ledger (:mod:`~qcluster.broker.amqp_periodic`)."""
        self._controls = SingleDocumentQueue(self.conn, CONTROLS_QUEUE, confirm_timeout_s)
        """The operator controls' document (:mod:`~qcluster.broker.amqp_single`)."""

    # --- settling -------------------------------------------------------------

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
                    (delivery.id, delivery.body,
                     _with_error({ATTEMPTS_HEADER: delivery.attempts}, settlement, delivery))
                )
        released = [d for d in settlement.release if live(d)]
        if released:
            # Unstarted: the copy records the takes before this one, as the original did.
            by_delay.setdefault(0, []).extend(
                (d.id, d.body, _released_headers(d)) for d in released
            )
        crashed = [d for d in settlement.crashed if live(d)]
        if crashed:
            # Counted and suspect, as a redelivery after its consumer died would be.
            by_delay.setdefault(0, []).extend(
                (d.id, d.body, {ATTEMPTS_HEADER: d.attempts, SUSPECT_HEADER: 1,
                                ACTIVATE_HEADER: d.activate_at}) for d in crashed)
        for delay_s, items in by_delay.items():
            self._send(queue, items, delay_s)
        # A refused job's take is not counted: its dead letter says the attempts that ran.
        dead_now = [(d, reason, d.attempts) for d, reason in settlement.dead]
        dead_now += [(d, reason, max(d.attempts - 1, 0)) for d, reason in settlement.refused]
        dead = [
            (d.id, d.body, _with_error({ATTEMPTS_HEADER: attempts, REASON_HEADER: reason[:4000],
                                        DEAD_AT_HEADER: time.time()}, settlement, d))
            for d, reason, attempts in dead_now if live(d)
        ]
        if dead:
            self._send(queue, dead, 0.0, dead=settlement.retention or self._retention)
        done = [d for d in settlement.ack + settlement.ack_held if live(d)]
        done += [d for d, _ in settlement.postpone if live(d)]
        done += [d for d, _, _ in dead_now if live(d)]
        done += released + crashed
        if state is not None and done:
            self._ack(state, {d.receipt[1] for d in done})

    # --- inspecting -----------------------------------------------------------

    def _delayed(self, queue: str) -> int:
        prefix = ladder_prefix(queue)
        if not self._count_exists(ndd.level_name(0, prefix)):
            return 0
        return sum(self._count(ndd.level_name(level, prefix)) for level in range(TOP_LEVEL + 1))

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
            if not self._dead_store_exists(queue):
                return []  # declared at the queue's first dead letter
            channel = self.conn.channel()
            try:
                messages = self._get_all(channel, dead_queue_name(queue), DEAD_SCAN_LIMIT)
            finally:
                channel.close()  # unacked: the broker puts them back, in order
            return [_dead_job(queue, m) for m in reversed(messages[-limit:])] if limit else []

        return self._retrying(peek)

    def dead_page(self, queue: str, *, offset: int = 0, limit: int = 50
                  ) -> tuple[int, list[DeadJob]]:
        """Oldest first (see :mod:`~qcluster.broker.amqp_jobs`)."""
        return amqp_jobs.dead_page(self, queue, offset=offset, limit=limit)

    def delete_dead(self, queue: str, ids: Sequence[str]) -> int:
        return amqp_jobs.dead_by_ids(self, queue, "delete", ids)

    def job(self, job_id: str, *, queues: Sequence[str] | None = None) -> JobInfo | None:
        return amqp_jobs.lookup(self, job_id, self.queues() if queues is None else queues)

    def job_page(self, queue: str, state: str, *, offset: int = 0, limit: int = 50,
                 running: Sequence[JobInfo] = ()) -> JobPage:
        return amqp_jobs.job_page(self, queue, state, offset=offset, limit=limit)

    def requeue_dead(self, queue: str, ids: Sequence[str] | None = None) -> int:
        check_queue_name(queue)
        if ids is not None:
            return amqp_jobs.dead_by_ids(self, queue, "requeue", ids)

        def move() -> int:
            self._declare(queue)
            if not self._dead_store_exists(queue):
                return 0  # declared at the queue's first dead letter
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

    # --- operator controls -----------------------------------------------------

    def read_controls(self) -> dict[str, bytes] | None:
        def read() -> dict[str, bytes] | None:
            channel = self._controls.open_existing()
            if channel is None:
                return {}  # never written (a reader does not create the queue)
            try:
                held = self._controls.hold(channel)
                return _newest(held)[1] if held else None
            finally:
                channel.close()  # unacked: the broker puts the document back

        return self._retrying(read)

    def write_control(self, key: str, value: bytes | None) -> None:
        def write() -> None:
            channel, created = self._controls.open()
            try:
                held = self._controls.hold_for_write(channel, created, CONTROL_HOLD_TRIES,
                                                     CONTROL_HOLD_WAIT_S)
                version, document = _newest(held) if held else (0, {})
                if value is None:
                    document.pop(key, None)
                else:
                    document[key] = value
                body = json.dumps({"version": version + 1, "controls": {
                    k: v.decode("utf-8", "replace") for k, v in sorted(document.items())}})
                self._controls.publish(channel, body.encode())
                if held:  # only now: until the new one is confirmed, the old one stays
                    channel.basic_ack(held[-1].delivery_tag, multiple=True)
            finally:
                channel.close()

        self._retrying(write)

    # --- periodic jobs (the lock and the ledger: qcluster.broker.amqp_periodic) ------

    def publish_tick(self, queue: str, job: str, tick_ms: int, job_id: str,
                     body: bytes) -> bool:
        check_queue_name(queue)
        return self._retrying(lambda: self._periodic.enqueue(
            self._declare, queue, job, tick_ms, job_id, body))

    def last_ticks(self) -> dict[str, int]:
        return self._retrying(self._periodic.last_ticks)

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


def _with_error(headers: dict[str, Any], settlement: Settlement,
                delivery: Delivery) -> dict[str, Any]:
    """``headers`` with the job's last error of this settlement, if it has one."""
    if settlement.errors:
        error = settlement.errors.get(delivery.id)
        if error is not None:
            headers[ERROR_HEADER] = error.to_json()
    return headers


def _newest(held: list[Any]) -> tuple[int, dict[str, bytes]]:
    return max((_control_document(_body(message)) for message in held), key=lambda d: d[0])


def _control_document(body: bytes) -> tuple[int, dict[str, bytes]]:
    """``(version, controls)``; a message that is not a document counts as an empty one of
    version 0 (the next write replaces it)."""
    try:
        document = json.loads(body)
    except ValueError:
        return 0, {}
    if not isinstance(document, dict) or not isinstance(document.get("controls"), dict):
        return 0, {}
    version = document.get("version")
    controls = {str(k): v.encode() for k, v in document["controls"].items()
                if isinstance(v, str)}
    return (version if isinstance(version, int) else 0), controls
