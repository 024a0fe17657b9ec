"""Periodic jobs' ticks on RabbitMQ (``Broker.publish_tick``): one manager enqueues them,
each once, and a record of each job's last enqueued tick survives it.

AMQP has no compare-and-set and cannot look a message up, so:

- **Who enqueues**: the manager whose connection holds the exclusive queue
  ``qc~periodic.lock``. RabbitMQ lets one connection declare it; another gets
  ``RESOURCE_LOCKED`` (and enqueues nothing). It is deleted when its connection closes (a
  killed manager's at once, a cut link's after the heartbeat timeout): the next manager
  that enqueues a tick takes it over.
- **What was enqueued, for sure**: each tick is one confirmed publish routed to the job's
  queue and, by its ``BCC`` header, to the job's receipt queue ``qc~periodic.tick.NAME``
  (``x-max-length`` 1: the last tick's message, its tick in the ``x-qcluster-tick``
  header). RabbitMQ routes a publish to both queues or to neither, so the receipt says
  whether a tick is enqueued even when its confirm was lost: the holder reads it once per
  hold of the lock (a retry after a reset takes the lock again on its new connection), and
  publishes nothing for a tick it finds there.
- **The record the managers read**: the durable queue ``qc~periodic.ledger``
  (``x-max-length`` 1: a new record replaces the old one) holds one JSON document,
  ``{"NAME": tick_ms}`` (:mod:`~qcluster.broker.amqp_single`), written by the holder after
  each tick; the holder's record of a job is the later of the ledger's and the receipt's.
  The holder reads the ledger when it takes the lock, so a restarted or second manager
  starts from the last tick enqueued. Anyone else peeks at it (takes it unacknowledged,
  gives it back; a reader never creates the queue). A peeked document given back after the
  holder wrote a newer one is the one the length limit drops (checked on RabbitMQ 3.10:
  the queue keeps the newer). A new holder starts from no record only when it creates the
  ledger; if the ledger exists but looks empty (another process holds the document, e.g. a
  stalled reader), it enqueues nothing and tries again at the next pass, never writing a
  fresh document that would lose the other jobs' records.

What it cannot promise: a tick whose queue was deleted while the holder's declaration of it
was still cached reaches the receipt alone (no ``basic.return``: the receipt took it) and is
lost.

``~`` is not allowed in a queue name (:mod:`qcluster.names`), so no user queue is either.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import amqp

from qcluster.broker.amqp_messages import ACTIVATE_HEADER
from qcluster.broker.amqp_single import DocumentHeld, SingleDocumentQueue
from qcluster.job import JSON_CONTENT_TYPE

logger = logging.getLogger(__name__)

LOCK_QUEUE = "qc~periodic.lock"
#: Followed by a periodic job's name: the queue of its receipts (see receipt_queue).
RECEIPT_PREFIX = "qc~periodic.tick."
#: An enqueued tick's message header naming its tick (read back from its receipt).
TICK_HEADER = "x-qcluster-tick"
LEDGER_QUEUE = "qc~periodic.ledger"
#: A new holder that finds the existing ledger empty looks again this often, this long
#: apart (another process may be peeking at the document for a round trip), then claims
#: nothing this pass.
EMPTY_LEDGER_TRIES = 10
EMPTY_LEDGER_WAIT_S = 0.05
#: After that, claims return False at once for this long (the ticker's next pass retries).
HELD_LEDGER_BACKOFF_S = 0.9


class PeriodicLedger:
    """The lock and the ledger over one kombu connection. Not thread-safe (the broker's
    caller serialises its calls); call inside the broker link's ``retrying``."""

    def __init__(self, conn: Any, confirm_timeout_s: float) -> None:
        self.conn = conn
        """The kombu Connection (its ``connection`` is the live py-amqp one)."""
        self.ledger = SingleDocumentQueue(conn, LEDGER_QUEUE, confirm_timeout_s)
        self._held_on: Any = None
        """The py-amqp connection that holds the lock (None: not held)."""
        self._channel: Any = None
        self._ticks: dict[str, int] = {}
        """The ledger as this holder last wrote or read it."""
        self._held_elsewhere_until = 0.0
        """Monotonic time before which no claim looks at the ledger again (it was held
        elsewhere): a pass with many due ticks waits once, not once per tick."""
        self._warned_held = False
        self._receipts: dict[str, int] = {}
        """Each job's receipt as read or written under this hold of the lock."""
        self._sent: tuple[str, int] | None = None
        """The (job, tick) last published: a call that finds it recorded after a lost
        confirm enqueued it."""

    def enqueue(self, declare: Callable[[str], None], queue: str, job: str, tick_ms: int,
                job_id: str, body: bytes) -> bool:
        """``Broker.publish_tick``: one publish routed to ``queue`` and to the job's
        receipt queue (``BCC``), so both hold the tick or neither does; then the ledger.
        A call after a lost confirm (the broker link's ``retrying`` calls again on a new
        connection) reads the receipt and publishes nothing more. ``declare`` declares
        ``queue`` as its policies say."""
        if not self._hold():
            return False  # another manager enqueues the periodic jobs
        recorded = max(self._ticks.get(job, -1), self._receipt(job))
        if tick_ms <= recorded:
            if self._ticks.get(job, -1) < recorded:  # a receipt the ledger missed
                self._write({**self._ticks, job: recorded})
            sent, self._sent = self._sent == (job, tick_ms), None
            return sent
        declare(queue)
        assert self._channel is not None
        message = amqp.Message(
            body, content_type=JSON_CONTENT_TYPE, delivery_mode=2, message_id=job_id,
            application_headers={ACTIVATE_HEADER: time.time(), TICK_HEADER: tick_ms,
                                 "BCC": [receipt_queue(job)]})
        self._sent = (job, tick_ms)
        # mandatory: a message routed nowhere raises (the receipt queue always takes it).
        self._channel.basic_publish_confirm(message, exchange="", routing_key=queue,
                                            mandatory=True,
                                            confirm_timeout=self.ledger.confirm_timeout_s)
        self._receipts[job] = tick_ms
        self._write({**self._ticks, job: tick_ms})
        self._sent = None
        return True

    def _receipt(self, job: str) -> int:
        """The job's last tick as its receipt queue holds it (-1: none), read once per
        hold of the lock: only the holder reads it or publishes to it."""
        if job not in self._receipts:
            receipts = SingleDocumentQueue(self.conn, receipt_queue(job), 0)
            channel, _ = receipts.open()
            try:
                held = receipts.hold(channel)
            finally:
                channel.close()  # unacked: given back
            self._receipts[job] = max((_tick_of(message) for message in held), default=-1)
        return self._receipts[job]

    def last_ticks(self) -> dict[str, int]:
        """The holder's record; anyone else reads the ledger (none when it does not exist)."""
        if self._held_on is not None and self._held_on is self.conn.connection:
            return dict(self._ticks)
        channel = self.ledger.open_existing()
        if channel is None:
            return {}
        try:
            return _latest(self.ledger.hold(channel))
        finally:
            channel.close()  # unacked: the broker puts the document back

    # --- the lock ------------------------------------------------------------------

    def _hold(self) -> bool:
        """Hold the lock on the live connection (taking it if free) and the ledger's
        record. False while another connection holds the lock, or while the existing
        ledger's document is held by another process (the next pass tries again)."""
        link = self.conn.connection
        if self._held_on is link and self._channel is not None and self._channel.is_open:
            return True
        self._held_on = self._channel = None
        self._receipts.clear()
        if time.monotonic() < self._held_elsewhere_until:
            return False  # the ledger was held elsewhere a moment ago: not every claim waits
        probe = self.conn.channel()
        try:
            probe.queue_declare(LOCK_QUEUE, exclusive=True, durable=False, auto_delete=False)
        except amqp.exceptions.ResourceLocked:
            return False  # the broker closed the probe's channel
        probe.close()
        channel, created = self.ledger.open()
        try:
            held = self.ledger.hold_for_write(channel, created, EMPTY_LEDGER_TRIES,
                                              EMPTY_LEDGER_WAIT_S)
        except DocumentHeld as exc:
            channel.close()
            self._held_elsewhere_until = time.monotonic() + HELD_LEDGER_BACKOFF_S
            if not self._warned_held:
                self._warned_held = True
                logger.warning("periodic jobs: no tick is claimed until the ledger is back: "
                               "%s", exc)
            return False
        self._warned_held = False
        self._ticks = _latest(held)
        for message in held:  # given back: the holder's writes replace them (length 1)
            channel.basic_reject(message.delivery_tag, requeue=True)
        self._held_on, self._channel = link, channel
        if created:  # at once: an existing ledger without a document refuses every holder
            self._write({})
        logger.info("this manager enqueues the periodic jobs (it holds %s)", LOCK_QUEUE)
        return True

    # --- the ledger ----------------------------------------------------------------

    def _write(self, ticks: dict[str, int]) -> None:
        """Publish the new document and wait for the broker's confirm; the queue's
        length limit drops the old one."""
        assert self._channel is not None
        self.ledger.publish(self._channel, json.dumps(ticks, sort_keys=True).encode())
        self._ticks = ticks


def receipt_queue(job: str) -> str:
    """Periodic job ``job``'s receipt queue: its last enqueued tick's job (x-max-length 1)."""
    return f"{RECEIPT_PREFIX}{job}"


def _tick_of(message: Any) -> int:
    headers = getattr(message, "headers", None) or {}
    try:
        return int(headers.get(TICK_HEADER, -1))
    except (TypeError, ValueError):
        return -1


def _latest(messages: list[Any]) -> dict[str, int]:
    """Every document's ticks, the latest per job."""
    ticks: dict[str, int] = {}
    for message in messages:
        for job, tick in _document(message.body).items():
            ticks[job] = max(tick, ticks.get(job, tick))
    return ticks


def _document(body: Any) -> dict[str, int]:
    """A ledger document's ticks; anything unreadable counts as none (logged)."""
    try:
        raw = json.loads(body)
        return {str(job): int(tick) for job, tick in raw.items()
                if isinstance(tick, int) and not isinstance(tick, bool)}
    except (ValueError, TypeError, AttributeError):
        logger.warning("the periodic jobs' ledger %s holds an unreadable record: ignored",
                       LEDGER_QUEUE)
        return {}
