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
#: Keys followed at once: past this, opening a window for a new key ends the oldest one
#: early. Windows are closed as they end, so this bounds the kinds failing within one
#: window (a safety net: they are bounded by the code's raise sites).
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
    """Which failures to log in full, and the summaries of the ones that were not.

    ``now`` never decreases from one call to the next (the caller's clock is monotonic),
    so the windows, kept in the order they opened, also end in that order: closing the
    ended ones looks at the oldest only.
    """

    def __init__(self, *, window_s: float = WINDOW_S, full_per_window: int = FULL_PER_WINDOW,
                 max_keys: int = MAX_KEYS) -> None:
        self.window_s = window_s
        self.full_per_window = full_per_window
        self.max_keys = max_keys
        self._windows: dict[Hashable, _Window] = {}
        """Open windows, oldest first."""
        self._ended: list[Summary] = []
        self.next_due = float("inf")
        """The earliest moment :meth:`due` has something to do (a cheap check for the
        caller: nothing is due before it)."""

    @property
    def held(self) -> int:
        """Windows open."""
        return len(self._windows)

    def admit(self, key: Hashable, now: float) -> bool:
        """One failure of ``key`` at ``now``: True to log it in full, False when it is
        only counted (its summary comes from :meth:`due`)."""
        window = self._windows.get(key)
        if window is not None and now >= window.start + self.window_s:
            self._end(key, window)
            window = None
        if window is None:
            self._open(key, now)
            return True
        if window.logged < self.full_per_window:
            window.logged += 1
            return True
        window.counted += 1
        window.last = now
        return False

    def due(self, now: float) -> list[Summary]:
        """Summaries of the windows that ended by ``now`` (each reported once)."""
        if now < self.next_due:
            return []
        self._close_ended(now)
        return self._take_ended()

    def flush(self) -> list[Summary]:
        """Every summary still open (a slot that stops says what it counted)."""
        for key, window in list(self._windows.items()):
            self._end(key, window)
        return self._take_ended()

    def _open(self, key: Hashable, now: float) -> None:
        if len(self._windows) >= self.max_keys:
            self._close_ended(now)
            if len(self._windows) >= self.max_keys:
                # More kinds failing at once than followed: the oldest window ends early
                # (its summary comes now) rather than leave the new kind unfollowed.
                oldest = next(iter(self._windows))
                self._end(oldest, self._windows[oldest])
        self._windows[key] = _Window(start=now)
        self._set_next_due()

    def _close_ended(self, now: float) -> None:
        windows = self._windows
        while windows:
            key, window = next(iter(windows.items()))
            if now < window.start + self.window_s:
                return
            self._end(key, window)

    def _end(self, key: Hashable, window: _Window) -> None:
        del self._windows[key]
        if window.counted:
            self._ended.append(Summary(key, window.counted, window.last - window.start))

    def _take_ended(self) -> list[Summary]:
        ended, self._ended = self._ended, []
        self._set_next_due()
        return ended

    def _set_next_due(self) -> None:
        if self._ended:
            self.next_due = float("-inf")
            return
        oldest = next(iter(self._windows.values()), None)
        self.next_due = float("inf") if oldest is None else oldest.start + self.window_s
