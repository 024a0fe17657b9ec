"""Keep a poison queue from flooding the log (pure: the caller passes the time).

Failures are grouped by a key (the queue, the exception's type and the line that raised
it). In each window of ``window_s`` seconds, opened by a key's first failure, the first
``full_per_window`` failures of a key are logged in full (with their traceback); the rest
are only counted, and once the window has ended one line says how many there were
("... and 312 more like it in 10 s").
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

#: Seconds a window lasts, from the first failure of its key.
WINDOW_S = 10.0
#: Failures of one key logged in full per window.
FULL_PER_WINDOW = 3
#: Keys followed at once: past this, a new key is logged in full without being followed
#: (the count of keys is bounded by the code's raise sites, so this is a safety net).
MAX_KEYS = 1000


@dataclass(slots=True)
class Summary:
    """The failures of one key that were counted, not logged, in one window."""

    key: Hashable
    count: int
    seconds: float
    """From the window's first failure to its last counted one."""


@dataclass(slots=True)
class _Window:
    start: float
    logged: int = 1
    counted: int = 0
    last: float = 0.0


class FailureSummariser:
    """Which failures to log in full, and the summaries of the ones that were not."""

    def __init__(self, *, window_s: float = WINDOW_S, full_per_window: int = FULL_PER_WINDOW,
                 max_keys: int = MAX_KEYS) -> None:
        self.window_s = window_s
        self.full_per_window = full_per_window
        self.max_keys = max_keys
        self._windows: dict[Hashable, _Window] = {}
        self._ended: list[Summary] = []
        self.next_due = float("inf")
        """The earliest moment a window with counted failures ends (a cheap check for
        the caller: nothing is due before it)."""

    def admit(self, key: Hashable, now: float) -> bool:
        """One failure of ``key`` at ``now``: True to log it in full, False when it is
        only counted (its summary comes from :meth:`due`)."""
        window = self._windows.get(key)
        if window is not None and now >= window.start + self.window_s:
            self._end(key, window)
            window = None
        if window is None:
            if len(self._windows) < self.max_keys:
                self._windows[key] = _Window(start=now)
            return True
        if window.logged < self.full_per_window:
            window.logged += 1
            return True
        window.counted += 1
        window.last = now
        self.next_due = min(self.next_due, window.start + self.window_s)
        return False

    def due(self, now: float) -> list[Summary]:
        """Summaries of the windows that ended by ``now`` (each reported once)."""
        if now < self.next_due and not self._ended:
            return []
        ended = [key for key, w in self._windows.items() if now >= w.start + self.window_s]
        for key in ended:
            self._end(key, self._windows[key])
        return self._take_ended()

    def flush(self) -> list[Summary]:
        """Every summary still open (a slot that stops says what it counted)."""
        for key, window in list(self._windows.items()):
            self._end(key, window)
        return self._take_ended()

    def _end(self, key: Hashable, window: _Window) -> None:
        del self._windows[key]
        if window.counted:
            self._ended.append(Summary(key, window.counted, window.last - window.start))

    def _take_ended(self) -> list[Summary]:
        ended, self._ended = self._ended, []
        starts = [w.start + self.window_s for w in self._windows.values() if w.counted]
        self.next_due = min(starts, default=float("inf"))
        return ended
