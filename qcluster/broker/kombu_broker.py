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
  ``x-delivery-count`` the same way, :func:`~qcluster.broker.amqp_messages.charged`).
- A message whose properties or headers cannot be read is handed to the slot marked
  ``malformed`` (the slot dead-letters it); nothing a producer sends stops a slot.
- Heartbeats (``?heartbeat=`` seconds in the URL, default 10) are sent by a small thread
  (so a long batch keeps the link alive) and checked each time frames are read, so a
  dead link ends in a reconnect or a clear error; ``?connect_timeout=`` and
  ``?write_timeout=`` bound connecting and writing.
- Operator controls (the manager's pause and drain) are one JSON document, the only
  message of the durable queue ``qc~controls``: :mod:`~qcluster.broker.amqp_controls`.
- ``stats``: ready and delayed come from the broker (``queue_declare(passive=True)``);
  AMQP cannot report other consumers' unacked messages, so ``locked`` counts only what
  this process holds.

The broker is composed of parts, each owning its own state (docs/layout.md, "The RabbitMQ
backend"): the link (:mod:`~qcluster.broker.amqp_link`: the connection, its epoch,
reconnects, heartbeats), the topology (:mod:`~qcluster.broker.amqp_topology`:
declarations, queue options), the publisher (:mod:`~qcluster.broker.amqp_publish`), the
consumers (:mod:`~qcluster.broker.amqp_consume`: takes, read-ahead, acks), the job reads
(:mod:`~qcluster.broker.amqp_jobs`: dead letters, lookups), the periodic ledger
(:mod:`~qcluster.broker.amqp_periodic`) and the controls
(:mod:`~qcluster.broker.amqp_controls`). Here: settling, inspecting, and the order in
which a lost connection resets the parts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from kombu.transport import native_delayed_delivery as ndd

from qcluster.broker.amqp_consume import BATCH_FILL_S, Consumers
from qcluster.broker.amqp_controls import CONTROLS_QUEUE, Controls
from qcluster.broker.amqp_jobs import JobReads
from qcluster.broker.amqp_link import MAX_BLOCK_S, URL_OPTIONS, AmqpLink, split_url_options
from qcluster.broker.amqp_messages import (
    ACTIVATE_HEADER,
    ATTEMPTS_HEADER,
    DEAD_AT_HEADER,
    ERROR_HEADER,
    REASON_HEADER,
    SUSPECT_HEADER,
    released_headers,
)
from qcluster.broker.amqp_periodic import PeriodicLedger
from qcluster.broker.amqp_publish import Publisher
from qcluster.broker.amqp_topology import (
    DEFAULT_MAX_ATTEMPTS,
    TOP_LEVEL,
    QueueType,
    Topology,
    dead_queue_name,
    ladder_prefix,
    legacy_dead_queue_name,
    queue_exchange,
    split_queue_type,
)
from qcluster.broker.base import Broker, DeadJob, DeadRetention, QueueStats, Settlement
from qcluster.job import Delivery
from qcluster.jobs import JobInfo, JobPage
from qcluster.names import check_queue_name
from qcluster.policy import DEFAULT_DEAD_MAX_AGE, DEFAULT_DEAD_MAX_COUNT

__all__ = [
    "ACTIVATE_HEADER", "ATTEMPTS_HEADER", "BATCH_FILL_S", "CONTROLS_QUEUE", "DEAD_AT_HEADER",
    "MAX_BLOCK_S", "REASON_HEADER", "SUSPECT_HEADER", "TOP_LEVEL", "URL_OPTIONS",
    "KombuBroker", "dead_queue_name", "ladder_prefix", "legacy_dead_queue_name",
    "queue_exchange", "split_url_options",
]

#: A settle's republished copies, by whole-second delay: (job id, body, headers).
Copies = dict[float, list[tuple[str, bytes, dict[str, Any]]]]


class KombuBroker(Broker):
    """Queue server on RabbitMQ through kombu (see the module docstring for the parts)."""

    def __init__(
        self,
        url: str,
        *,
        max_retries: int = 5,
        connect_timeout_s: float | None = None,
        confirm_timeout_s: float = 30.0,
        dead_max_count: int = DEFAULT_DEAD_MAX_COUNT,
        dead_max_age_s: float = DEFAULT_DEAD_MAX_AGE,
        give_up_s: float | None = None,
    ) -> None:
        """``dead_max_count``/``dead_max_age_s``: dead-letter retention for a settle
        whose ``retention`` is None (a slot passes its queue's policy). ``give_up_s``: a
        call that cannot reach the broker raises that long after it began (short-lived
        callers, :data:`~qcluster.broker.base.SHORT_LIVED_GIVE_UP_S`); None: after
        ``max_retries`` connects, each retried with backoff (long-lived processes)."""
        self._retention = DeadRetention(dead_max_count, dead_max_age_s)
        url, default_type = split_queue_type(url)
        self.link = AmqpLink(url, max_retries=max_retries, connect_timeout_s=connect_timeout_s,
                             confirm_timeout_s=confirm_timeout_s, give_up_s=give_up_s,
                             on_lost=self._connection_lost, on_wait=self._waiting)
        self.topology = Topology(self.link, default_type)
        self.publisher = Publisher(self.link, self.topology)
        self.consumers = Consumers(self.link, self.topology, self.publisher)
        self.job_reads = JobReads(self.link, self.topology, self.publisher)
        self.periodic = PeriodicLedger(self.link.conn, confirm_timeout_s)
        self.controls = Controls(self.link.conn, confirm_timeout_s)
        # What callers read of a broker (manager.job_reads opens another like it).
        self.url, self.safe_url = self.link.url, self.link.safe_url
        self.max_retries, self.confirm_timeout_s = max_retries, confirm_timeout_s

    @property
    def conn(self) -> Any:
        """The kombu Connection (its ``connection`` is the live py-amqp one)."""
        return self.link.conn

    def _connection_lost(self) -> None:
        """The connection was lost or closed, before the link forgets its own channels and
        starts a new epoch: the consumers first (their channels and deliveries: the
        broker hands the unacked jobs out again), then the publisher (its confirmed
        channel), then the topology (everything is declared again on the next
        connection). The periodic ledger and the controls check the live connection
        themselves at each call."""
        self.consumers.reset()
        self.publisher.reset()
        self.topology.reset()

    def _waiting(self) -> None:
        """Between reconnect attempts (each may take connect_timeout through a dead link):
        let the caller show it is alive (Broker.on_wait)."""
        if self.on_wait is not None:
            self.on_wait()

    # --- queue options, publishing, taking --------------------------------------

    def set_queue_options(self, queue: str, *, queue_type: str | None = None,
                          max_attempts: int = DEFAULT_MAX_ATTEMPTS) -> None:
        """See :meth:`~qcluster.broker.amqp_topology.Topology.set_queue_options`."""
        self.topology.set_queue_options(queue, queue_type=queue_type, max_attempts=max_attempts)

    def queue_type(self, queue: str) -> QueueType:
        """The type ``queue`` is declared with (as it exists, once declared)."""
        return self.topology.queue_type(queue)

    def publish_many(
        self, queue: str, messages: Sequence[tuple[str, bytes]], *, delay_s: float = 0.0
    ) -> list[str]:
        """Every message is stored and returned as new: AMQP cannot look an id up in a
        queue (base.Broker.publish_many)."""
        check_queue_name(queue)
        items: list[tuple[str, bytes, dict[str, Any]]] = [
            (job_id, body, {}) for job_id, body in messages
        ]
        self.link.retrying(lambda: self.publisher.send(queue, items, delay_s))
        return list(dict.fromkeys(job_id for job_id, _ in messages))

    def take(
        self, queue: str, *, max_jobs: int, lock_timeout_s: float, wait_s: float = 0.0
    ) -> list[Delivery]:
        check_queue_name(queue)
        return self.link.retrying(
            lambda: self.consumers.take(queue, max_jobs, wait_s, lock_timeout_s))

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
        return self.link.retrying(
            lambda: self.consumers.take(queue, max_jobs, wait_s, lock_timeout_s, ahead))

    def leave(self, queue: str) -> None:
        """Cancel the queue's consumer and give its read-ahead deliveries back, not
        charged; jobs handed out and not settled stay locked until settled or expired."""
        if self.consumers.get(queue) is None:
            self.consumers.leave(queue)  # nothing to cancel: no connection needed
        else:
            self.link.retrying(lambda: self.consumers.leave(queue))

    # --- settling -------------------------------------------------------------

    def settle(self, queue: str, settlement: Settlement) -> None:
        if len(settlement):
            self.link.retrying(lambda: self._settle(queue, settlement))

    def _settle(self, queue: str, settlement: Settlement) -> None:
        state = self.consumers.get(queue)
        epoch = self.link.epoch

        def live(delivery: Delivery) -> bool:
            # A delivery of an earlier connection is no longer ours: the broker gives
            # it out again, so republishing it would only duplicate it.
            delivery_epoch, tag = delivery.receipt
            return state is not None and delivery_epoch == epoch and tag in state.held

        for delay_s, items in _copies(settlement, live).items():
            self.publisher.send(queue, items, delay_s)
        # A refused job's take is not counted: its dead letter says the attempts that ran.
        dead_now = [(d, reason, d.attempts) for d, reason in settlement.dead]
        dead_now += [(d, reason, max(d.attempts - 1, 0)) for d, reason in settlement.refused]
        dead = [
            (d.id, d.body, _with_error({ATTEMPTS_HEADER: attempts, REASON_HEADER: reason[:4000],
                                        DEAD_AT_HEADER: time.time()}, settlement, d))
            for d, reason, attempts in dead_now if live(d)
        ]
        if dead:
            self.publisher.send(queue, dead, 0.0, dead=settlement.retention or self._retention)
        done = [d for d in settlement.ack + settlement.ack_held if live(d)]
        done += [d for d, _ in settlement.postpone if live(d)]
        done += [d for d, _, _ in dead_now if live(d)]
        done += [d for d in settlement.release + settlement.crashed if live(d)]
        if state is not None and done:
            self.consumers.ack(state, {d.receipt[1] for d in done})

    # --- inspecting -----------------------------------------------------------

    def _delayed(self, queue: str) -> int:
        prefix = ladder_prefix(queue)
        if not self.link.exists(ndd.level_name(0, prefix)):
            return 0
        return sum(self.link.count(ndd.level_name(level, prefix))
                   for level in range(TOP_LEVEL + 1))

    def stats(self, queue: str) -> QueueStats:
        check_queue_name(queue)

        def read() -> QueueStats:
            return QueueStats(
                ready=self.link.count(queue), locked=self.consumers.locked(queue),
                delayed=self._delayed(queue), dead=self.link.count(dead_queue_name(queue)),
            )

        return self.link.retrying(read)

    def queues(self) -> list[str]:
        """Queues this process used: AMQP cannot list a broker's queues."""
        return sorted(self.topology.seen)

    def dead_jobs(self, queue: str, *, limit: int = 100) -> list[DeadJob]:
        """Newest first: peeks with basic_get and gives every message back by closing the
        channel (:mod:`~qcluster.broker.amqp_jobs`)."""
        return self.job_reads.dead_jobs(queue, limit)

    def dead_page(self, queue: str, *, offset: int = 0, limit: int = 50
                  ) -> tuple[int, list[DeadJob]]:
        """Oldest first: the store is a queue (see :mod:`~qcluster.broker.amqp_jobs`)."""
        return self.job_reads.dead_page(queue, offset=offset, limit=limit)

    def delete_dead(self, queue: str, ids: Sequence[str]) -> int:
        return self.job_reads.dead_by_ids(queue, "delete", ids)

    def job(self, job_id: str, *, queues: Sequence[str] | None = None) -> JobInfo | None:
        names = self.queues() if queues is None else queues
        if not names:
            # Nothing to look in (this process used no queue yet): a broker that does not
            # answer is still said (BrokerUnavailable), not taken for a job found nowhere.
            self.ping()
        return self.job_reads.lookup(job_id, names)

    def job_page(self, queue: str, state: str, *, offset: int = 0, limit: int = 50,
                 running: Sequence[JobInfo] = ()) -> JobPage:
        return self.job_reads.job_page(queue, state, offset=offset, limit=limit)

    def requeue_dead(self, queue: str, ids: Sequence[str] | None = None) -> int:
        if ids is not None:
            return self.job_reads.dead_by_ids(queue, "requeue", ids)
        return self.job_reads.requeue_all(queue)

    def purge(self, queue: str) -> int:
        check_queue_name(queue)

        def purge() -> int:
            if not self.link.exists(queue):
                return 0  # nothing to delete; not created (amqp_jobs.JobReads._store_exists)
            self.topology.declare(queue)
            count = int(self.link.inspector().queue_purge(queue) or 0)
            prefix = ladder_prefix(queue)
            if self.link.exists(ndd.level_name(0, prefix)):
                channel = self.link.inspector()
                for level in range(TOP_LEVEL + 1):
                    count += int(channel.queue_purge(ndd.level_name(level, prefix)) or 0)
            return count

        return self.link.retrying(purge)

    # --- operator controls (qcluster.broker.amqp_controls) ----------------------

    def read_controls(self) -> dict[str, bytes] | None:
        return self.link.retrying(self.controls.read)

    def write_control(self, key: str, value: bytes | None) -> None:
        self.link.retrying(lambda: self.controls.write(key, value))

    # --- periodic jobs (the lock and the ledger: qcluster.broker.amqp_periodic) ------

    def publish_tick(self, queue: str, job: str, tick_ms: int, job_id: str,
                     body: bytes) -> bool:
        check_queue_name(queue)
        return self.link.retrying(lambda: self.periodic.enqueue(
            self.topology.declare, queue, job, tick_ms, job_id, body))

    def last_ticks(self) -> dict[str, int]:
        return self.link.retrying(self.periodic.last_ticks)

    # --- the connection --------------------------------------------------------

    def ping(self) -> None:
        self.link.retrying(lambda: None)

    def close(self) -> None:
        self.link.close()

    def reader(self) -> KombuBroker:
        # A kombu connection serves one thread at a time: another thread gets its own.
        return KombuBroker(self.url, max_retries=self.max_retries,
                           confirm_timeout_s=self.confirm_timeout_s,
                           give_up_s=self.link.give_up_s)

    def delete_queue(self, queue: str) -> None:
        """Remove the queue, its dead-letter queue and its delay ladder (tests; loses jobs)."""

        def delete() -> None:
            self.consumers.forget(queue)  # our own consumer first: no Basic.cancel then
            channel = self.link.inspector()
            prefix = ladder_prefix(queue)
            for name in (queue, dead_queue_name(queue)):
                channel.queue_delete(name)
            for level in range(TOP_LEVEL + 1):
                channel.queue_delete(ndd.level_name(level, prefix))
                channel.exchange_delete(ndd.level_name(level, prefix))
            channel.exchange_delete(f"{prefix}_{ndd.CELERY_DELAYED_DELIVERY_EXCHANGE}")
            channel.exchange_delete(queue_exchange(queue).name)
            self.topology.forget(queue)

        self.link.retrying(delete)


def _copies(settlement: Settlement, live: Any) -> Copies:
    """What a settle republishes before its ack, by whole-second delay (one confirmed
    publish round per ladder route): postponed, released and crashed jobs."""
    by_delay: Copies = {}
    for delivery, delay_s in settlement.postpone:
        if live(delivery):
            by_delay.setdefault(math.ceil(delay_s), []).append(
                (delivery.id, delivery.body,
                 _with_error({ATTEMPTS_HEADER: delivery.attempts}, settlement, delivery)))
    released = [d for d in settlement.release if live(d)]
    if released:
        # Unstarted: the copy records the takes before this one, as the original did.
        by_delay.setdefault(0, []).extend(
            (d.id, d.body, released_headers(d)) for d in released)
    crashed = [d for d in settlement.crashed if live(d)]
    if crashed:
        # Counted and suspect, as a redelivery after its consumer died would be.
        by_delay.setdefault(0, []).extend(
            (d.id, d.body, {ATTEMPTS_HEADER: d.attempts, SUSPECT_HEADER: 1,
                            ACTIVATE_HEADER: d.activate_at}) for d in crashed)
    return by_delay


def _with_error(headers: dict[str, Any], settlement: Settlement,
                delivery: Delivery) -> dict[str, Any]:
    """``headers`` with the job's last error of this settlement, if it has one."""
    if settlement.errors:
        error = settlement.errors.get(delivery.id)
        if error is not None:
            headers[ERROR_HEADER] = error.to_json()
    return headers

