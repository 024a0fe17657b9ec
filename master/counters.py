"""What the master counted: job counters waiting for the next report, slot restarts.

The supervisor loop adds; the reporter thread takes (and gives back what it could not
deliver); the HTTP thread reads the restarts. One lock, held only for dict operations.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from qcluster.messages import BatchCounters


class MasterCounters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, BatchCounters] = {}
        self._restarts: dict[tuple[str, str], int] = {}

    def add_batch(self, queue: str, counters: BatchCounters) -> None:
        with self._lock:
            self._pending[queue] = self._pending.get(queue, BatchCounters()) + counters

    def take(self) -> dict[str, BatchCounters]:
        """Counters since the last take (the reporter's)."""
        with self._lock:
            pending, self._pending = self._pending, {}
        return pending

    def give_back(self, counters: Mapping[str, BatchCounters]) -> None:
        """An undelivered report's counters: they go into the next one."""
        for queue, counted in counters.items():
            self.add_batch(queue, counted)

    def count_restart(self, queue: str, reason: str) -> None:
        with self._lock:
            self._restarts[(queue, reason)] = self._restarts.get((queue, reason), 0) + 1

    def restarts(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._restarts)
