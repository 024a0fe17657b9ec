"""Periodic jobs' claims on RabbitMQ: one manager enqueues them, and a record of each
job's last enqueued tick survives it.

AMQP has no compare-and-set, so the claim is made of two parts:

- **Who enqueues**: the manager whose connection holds the exclusive queue
  ``qc~periodic.lock``. RabbitMQ lets one connection declare it; another gets
  ``RESOURCE_LOCKED`` (and claims nothing). It is deleted when its connection closes (a
  killed manager's at once, a cut link's after the heartbeat timeout): the next manager
  that claims a tick takes it over.
- **What was enqueued**: the durable queue ``qc~periodic.ledger`` (``x-max-length`` 1: a
  new record replaces the old one) holds one JSON document, ``{"NAME": tick_ms}``. Only
  the lock's holder writes it (confirmed before a tick is enqueued); it reads it when it
  takes the lock, so a restarted or second manager starts from the last tick enqueued.
  Anyone else peeks at it (takes it unacknowledged, gives it back). A peeked document given
  back after the holder wrote a newer one is the one the length limit drops (checked on
  RabbitMQ 3.10: the queue keeps the newer); a new holder that finds the queue empty looks
  again for half a second, in case a reader held the document just then.

``~`` is not allowed in a queue name (:mod:`qcluster.names`), so no user queue is either.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import amqp

logger = logging.getLogger("qcluster.broker.kombu_broker")

LOCK_QUEUE = "qc~periodic.lock"
LEDGER_QUEUE = "qc~periodic.ledger"
LEDGER_ARGUMENTS = {"x-max-length": 1}
#: At most this many ledger documents are read (one, unless readers raced a writer).
LEDGER_READ_LIMIT = 10
#: A new holder that finds the ledger empty looks again this often, this long apart: another
#: process may be peeking at the document (it holds it for a round trip).
EMPTY_LEDGER_TRIES = 10
EMPTY_LEDGER_WAIT_S = 0.05


class PeriodicLedger:
    """The lock and the ledger over one kombu connection. Not thread-safe (the broker's
    caller serialises its calls); call inside the broker's ``_retrying``."""

    def __init__(self, conn: Any, confirm_timeout_s: float) -> None:
        self.conn = conn
        """The kombu Connection (its ``connection`` is the live py-amqp one)."""
        self.confirm_timeout_s = confirm_timeout_s
        self._held_on: Any = None
        """The py-amqp connection that holds the lock (None: not held)."""
        self._channel: Any = None
        self._ticks: dict[str, int] = {}
        """The ledger as this holder last wrote or read it."""

    def claim(self, job: str, tick_ms: int) -> bool:
        if not self._hold():
            return False
        if tick_ms <= self._ticks.get(job, -1):
            return False
        self._write({**self._ticks, job: tick_ms})
        return True

    def unclaim(self, job: str, tick_ms: int, previous_ms: int | None) -> None:
        if not self._hold() or self._ticks.get(job) != tick_ms:
            return
        ticks = dict(self._ticks)
        if previous_ms is None:
            ticks.pop(job, None)
        else:
            ticks[job] = previous_ms
        self._write(ticks)

    def last_ticks(self) -> dict[str, int]:
        """The holder's record; anyone else reads the ledger."""
        if self._held_on is not None and self._held_on is self.conn.connection:
            return dict(self._ticks)
        return self._read(self._ledger_channel(), close=True)

    # --- the lock ------------------------------------------------------------------

    def _hold(self) -> bool:
        """Hold the lock on the live connection (taking it if free); read the ledger when
        it is newly taken. False while another connection holds it."""
        link = self.conn.connection
        if self._held_on is link and self._channel is not None and self._channel.is_open:
            return True
        self._held_on = self._channel = None
        probe = self.conn.channel()
        try:
            probe.queue_declare(LOCK_QUEUE, exclusive=True, durable=False, auto_delete=False)
        except amqp.exceptions.ResourceLocked:
            return False  # the broker closed the probe's channel
        probe.close()
        channel = self._ledger_channel()
        self._ticks = self._read(channel, close=False)
        for _ in range(EMPTY_LEDGER_TRIES):
            if self._ticks:
                break
            time.sleep(EMPTY_LEDGER_WAIT_S)  # never written, or a reader holds it just now
            self._ticks = self._read(channel, close=False)
        self._held_on, self._channel = link, channel
        logger.info("this manager enqueues the periodic jobs (it holds %s)", LOCK_QUEUE)
        return True

    # --- the ledger ----------------------------------------------------------------

    def _ledger_channel(self) -> Any:
        channel = self.conn.channel()
        channel.queue_declare(LEDGER_QUEUE, durable=True, auto_delete=False,
                              arguments=LEDGER_ARGUMENTS)
        return channel

    def _read(self, channel: Any, *, close: bool) -> dict[str, int]:
        """Every document's ticks, the latest per job; the documents are given back."""
        ticks: dict[str, int] = {}
        messages = []
        for _ in range(LEDGER_READ_LIMIT):
            message = channel.basic_get(LEDGER_QUEUE, no_ack=False)
            if message is None:
                break
            messages.append(message)
            for job, tick in _document(message.body).items():
                ticks[job] = max(tick, ticks.get(job, tick))
        for message in messages:
            channel.basic_reject(message.delivery_tag, requeue=True)
        if close:
            channel.close()
        return ticks

    def _write(self, ticks: dict[str, int]) -> None:
        """Publish the new document and wait for the broker's confirm; the queue's
        length limit drops the old one."""
        assert self._channel is not None
        body = json.dumps(ticks, sort_keys=True).encode()
        message = amqp.Message(body, content_type="application/json", delivery_mode=2)
        self._channel.basic_publish_confirm(message, exchange="", routing_key=LEDGER_QUEUE,
                                            confirm_timeout=self.confirm_timeout_s)
        self._ticks = ticks


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
