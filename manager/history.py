"""A queue's history: its round points of the last hour in a fixed array
(:class:`HistoryRing`), and the copy of a window of them the views read
(:class:`HistoryWindow`)."""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterator, Sequence
from typing import overload

from qcluster.messages import HistoryPoint

HISTORY_S = 3600.0
#: A point's fields in the order the ring stores them (a load of None is stored as NaN).
COLUMNS = ("at", "backlog", "slots_planned", "slots_current", "load", "rate_out")


class HistoryRing:
    """A queue's history points of the last HISTORY_S, as six floats each in one array
    allocated whole at the queue's first point: its memory is fixed from then on (a deque
    of HistoryPoint models grew for the whole first hour, ~0.3 MiB a minute in the L4
    soak, and held about ten times as much). Points are built when read. Holds
    ``capacity`` points: at most an hour at the round interval it was sized for."""

    _WIDTH = 6  # at, backlog, slots_planned, slots_current, load (NaN: None), rate_out

    def __init__(self) -> None:
        self._columns = array("d")
        self._start = 0
        self._len = 0

    @property
    def capacity(self) -> int:
        return len(self._columns) // self._WIDTH

    def __len__(self) -> int:
        return self._len

    def append(self, point: HistoryPoint, *, capacity: int) -> None:
        if not self._columns:
            self._columns = array("d", bytes(8 * self._WIDTH * max(1, capacity)))
        if self._len == self.capacity:  # full: the oldest point goes
            self._start = (self._start + 1) % self.capacity
            self._len -= 1
        at = (self._start + self._len) % self.capacity * self._WIDTH
        load = math.nan if point.load is None else point.load
        self._columns[at : at + self._WIDTH] = array("d", (
            point.at, point.backlog, point.slots_planned, point.slots_current, load,
            point.rate_out))
        self._len += 1

    def drop_before(self, cutoff: float) -> None:
        while self._len and self._columns[self._start * self._WIDTH] < cutoff:
            self._start = (self._start + 1) % self.capacity
            self._len -= 1

    def __iter__(self) -> Iterator[HistoryPoint]:
        return self._points()

    def since(self, cutoff: float) -> HistoryWindow:
        """The points at or after ``cutoff``, oldest first, as a copy of their numbers:
        taken under the state lock, the points are built when read, after it (the views
        read the window's few points out of an hour's, for every queue)."""
        columns, width, skip, capacity = self._columns, self._WIDTH, self._len, self.capacity
        while skip and columns[(self._start + skip - 1) % capacity * width] >= cutoff:
            skip -= 1
        return HistoryWindow(self._copy(skip))

    def _copy(self, first: int) -> array[float]:
        """The columns of points ``first`` to the newest, in order (at most two slices)."""
        if first >= self._len:
            return array("d")
        width, capacity = self._WIDTH, self.capacity
        head = (self._start + first) % capacity
        tail = (self._start + self._len - 1) % capacity
        if head <= tail:
            return self._columns[head * width : (tail + 1) * width]
        return self._columns[head * width :] + self._columns[: (tail + 1) * width]

    def _points(self) -> Iterator[HistoryPoint]:
        return iter(HistoryWindow(self._copy(0)))


#: Spare room in a queue's HistoryRing beyond an hour of rounds (a late round, a restart
#: of the loop).
HISTORY_SPARE = 16




class HistoryWindow(Sequence[HistoryPoint]):
    """Some of a ring's points, as a copy of their numbers (six floats each): copying is
    one array slice, so the views take it under the state lock and build the points
    (``HistoryPoint.model_construct``, ~20 us each: 4,500 per read at 150 queues) after."""

    def __init__(self, columns: array[float]) -> None:
        self._columns = columns

    def __len__(self) -> int:
        return len(self._columns) // HistoryRing._WIDTH

    @overload
    def __getitem__(self, index: int) -> HistoryPoint: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[HistoryPoint]: ...

    def __getitem__(self, index: int | slice) -> HistoryPoint | Sequence[HistoryPoint]:
        if isinstance(index, slice):
            return [self[n] for n in range(len(self))[index]]
        count = len(self)
        if not -count <= index < count:
            raise IndexError(index)
        width = HistoryRing._WIDTH
        at = (index % count) * width
        when, backlog, planned, current, load, rate = self._columns[at : at + width]
        return HistoryPoint.model_construct(  # the values were validated when added
            at=when, backlog=int(backlog), slots_planned=int(planned),
            slots_current=int(current), load=None if math.isnan(load) else load,
            rate_out=rate)

    def __iter__(self) -> Iterator[HistoryPoint]:
        return (self[n] for n in range(len(self)))

    def column(self, field: str) -> list[float]:
        """One field of every point, oldest first, without building the points."""
        return list(self._columns[COLUMNS.index(field) :: HistoryRing._WIDTH])


def column(points: Sequence[HistoryPoint], field: str) -> list[float]:
    """One field of each point (of a HistoryWindow: read from its numbers)."""
    if isinstance(points, HistoryWindow):
        return points.column(field)
    return [float(getattr(point, field)) for point in points]
