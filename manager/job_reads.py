"""The job routes' broker reads (a lookup by id, a page of a queue's jobs), kept off the
service's shared broker lock: the planning round, the periodic ticker and the controls use
that lock, and a RabbitMQ lookup reads up to thousands of dead letters. The reads take a
lock of their own, on a broker connection of their own where the backend needs one, and at
most ``MAX_JOB_READS`` wait at a time: more are refused (``JobReadsBusy``) rather than queued.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from qcluster.broker.base import Broker
from qcluster.errors import BrokerError

T = TypeVar("T")
#: Job reads running or waiting at once; one more is refused (HTTP 429).
MAX_JOB_READS = 4


class JobReadsBusy(BrokerError):
    """As many job reads as allowed are running or waiting: try again shortly."""


def reader_for(broker: Broker) -> Broker:
    """The broker the job reads use: RabbitMQ, a connection of its own (a kombu connection
    serves one thread at a time); the Redis backends, the same broker (its client keeps a
    pool: each thread gets a connection of its own). See :meth:`Broker.reader`."""
    return broker.reader()


class JobReads:
    """Runs each job read on the reader, opened at the first read and kept."""

    def __init__(self, shared: Callable[[], Broker], max_reads: int = MAX_JOB_READS,
                 open_reader: Callable[[Broker], Broker] = reader_for) -> None:
        self._shared = shared
        self._open_reader = open_reader
        self._reader: Broker | None = None
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_reads)
        self._max_reads = max_reads
        self._paged: set[str] = set()
        self._paged_lock = threading.Lock()

    def read(self, call: Callable[[Broker], T]) -> T:
        """``call(reader)`` under the reads' own lock. Raises JobReadsBusy when
        ``max_reads`` reads already run or wait."""
        if not self._slots.acquire(blocking=False):
            raise JobReadsBusy(f"{self._max_reads} job lookups are already running or "
                               "waiting: try again in a moment")
        try:
            with self._lock:
                if self._reader is None:
                    self._reader = self._open_reader(self._shared())
                return call(self._reader)
        finally:
            self._slots.release()

    def paged(self, queue: str) -> None:
        """Remember a queue listed here: RabbitMQ cannot list a broker's queues, and a
        lookup looks in the ones used (the shared broker's and these)."""
        with self._paged_lock:
            self._paged.add(queue)

    def queues(self) -> set[str]:
        with self._paged_lock:
            return set(self._paged)

    def close(self) -> None:
        """Close the reader if it is a connection of its own."""
        with self._lock:
            reader, self._reader = self._reader, None
        if reader is not None and reader is not self._shared():
            reader.close()
