"""A durable RabbitMQ queue that holds one JSON document (``x-max-length`` 1): the operator
controls (``qc~controls``) and the periodic jobs' ledger (``qc~periodic.ledger``).

AMQP has no key-value store, so the document is the queue's only message. A process
reads it by taking it unacknowledged and giving it back; while it holds it, the queue
looks empty to everyone else. So an empty queue is ambiguous: never written, or held by
someone just now (a reader stalled mid-read by SIGSTOP or a cut link holds it until its
connection is closed, which may take a heartbeat timeout). A writer that took "empty" for
"never written" would publish a document with only its own change, and when the holder
lets go, the length limit would keep the newer one: every other entry lost.

The rule here: only the call that **creates** the queue may start from an empty document
(:meth:`SingleDocumentQueue.open` declares passively first: 404 means this call may create
it; of several calls that find no queue at once, only the one holding the queue's creation
lock, an exclusive queue ``NAME~creating`` that the broker frees with its connection,
creates it, and the others open it as existing). If the queue existed and holds no
document, someone holds it: the caller does not write (:class:`DocumentHeld`) and tries
again later. Readers never create the queue (a reader that did would leave it empty and
make every writer refuse).

A creator killed between its declare and its first confirmed write leaves an existing,
empty queue that every writer refuses: deleting the queue (``rabbitmqctl delete_queue``)
starts again from no document; the error says so.
"""

from __future__ import annotations

import time
from typing import Any

import amqp

from qcluster.errors import BrokerUnavailable

#: Of a few documents (a writer died between its confirmed publish and its ack of the old
#: one) the caller picks; more than this is never expected.
SCAN_LIMIT = 10
#: Of several processes that find the queue missing, the ones that do not hold its
#: creation lock look again this often, this long apart (the lock is held for three
#: round trips), then refuse.
CREATE_TRIES = 40
CREATE_WAIT_S = 0.05


class DocumentHeld(BrokerUnavailable):
    """The queue exists but its document is held by another process (or was lost): the
    caller must not write a fresh one; trying again later is safe."""


class SingleDocumentQueue:
    """One queue's document over a kombu connection (``conn.channel()`` opens a channel).
    Not thread-safe; call inside the broker link's ``retrying``."""

    def __init__(self, conn: Any, queue: str, confirm_timeout_s: float) -> None:
        self.conn = conn
        self.queue = queue
        self.confirm_timeout_s = confirm_timeout_s
        self.arguments = {"x-max-length": 1}

    def open(self) -> tuple[Any, bool]:
        """A channel on the queue and whether this call created it (at most one call
        does, however many find the queue missing at once)."""
        for attempt in range(CREATE_TRIES):
            if (channel := self._existing()) is not None:
                return channel, False
            if (opened := self._create()) is not None:
                return opened
            if attempt + 1 < CREATE_TRIES:
                time.sleep(CREATE_WAIT_S)
        raise DocumentHeld(f"RabbitMQ queue {self.queue} is being created by another "
                           f"process (it holds {self.queue}~creating): try again")

    def _create(self) -> tuple[Any, bool] | None:
        """Under the creation lock: a channel on the queue and whether this call created
        it; None while another connection holds the lock."""
        lock = f"{self.queue}~creating"
        guard = self.conn.channel()
        try:
            guard.queue_declare(lock, exclusive=True, durable=False, auto_delete=False)
        except amqp.exceptions.ResourceLocked:
            return None  # the broker closed that channel
        try:
            if (channel := self._existing()) is not None:
                return channel, False  # created by the lock's last holder
            channel = self.conn.channel()
            channel.queue_declare(self.queue, durable=True, auto_delete=False,
                                  arguments=self.arguments)
            return channel, True
        finally:
            guard.queue_delete(lock)
            guard.close()

    def open_existing(self) -> Any | None:
        """A channel on the queue, or None when it does not exist (readers: never create)."""
        return self._existing()

    def _existing(self) -> Any | None:
        channel = self.conn.channel()
        try:
            channel.queue_declare(self.queue, passive=True)
        except amqp.exceptions.NotFound:
            return None  # the broker closed that channel
        return channel

    def hold(self, channel: Any) -> list[Any]:
        """Every document in the queue, taken unacknowledged (given back when ``channel``
        closes or they are rejected): one, unless a writer died between its publish and
        its ack."""
        held: list[Any] = []
        while len(held) < SCAN_LIMIT:
            message = channel.basic_get(self.queue, no_ack=False)
            if message is None:
                break
            held.append(message)
        return held

    def hold_for_write(self, channel: Any, created: bool, tries: int = 1,
                       wait_s: float = 0.05) -> list[Any]:
        """The documents to replace; empty only when this call created the queue. An
        existing queue found empty ``tries`` times (``wait_s`` apart) raises DocumentHeld."""
        for attempt in range(tries):
            held = self.hold(channel)
            if held or created:
                return held
            if attempt + 1 < tries:
                time.sleep(wait_s)
        raise DocumentHeld(
            f"RabbitMQ queue {self.queue} holds no document just now: another process "
            "holds it (try again), or it was emptied (delete the queue to start from none)")

    def publish(self, channel: Any, body: bytes) -> None:
        """Publish the new document and wait for RabbitMQ's confirm."""
        message = amqp.Message(body, content_type="application/json", delivery_mode=2)
        channel.basic_publish_confirm(message, exchange="", routing_key=self.queue,
                                      confirm_timeout=self.confirm_timeout_s)
