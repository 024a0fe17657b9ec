"""Issue 16 L4: the manager's hour of history per queue is a ring of fixed memory (its
array is allocated whole at the queue's first point), read back as the points it got."""

from __future__ import annotations

from collections import deque

from hypothesis import given
from hypothesis import strategies as st

from qcluster.manager.history import HISTORY_S, HistoryRing
from qcluster.messages import HistoryPoint

points = st.builds(
    HistoryPoint, at=st.just(0.0), backlog=st.integers(0, 1 << 40),
    slots_planned=st.integers(0, 10_000), slots_current=st.integers(0, 10_000),
    load=st.none() | st.floats(0, 1e6, allow_nan=False), rate_out=st.floats(0, 1e6))


@given(st.lists(st.tuples(st.floats(0.001, 900.0), points), max_size=60),
       st.integers(1, 40))
def test_the_ring_keeps_what_a_deque_of_the_last_hour_would_up_to_its_capacity(
    steps: list[tuple[float, HistoryPoint]], capacity: int
) -> None:
    ring, expected = HistoryRing(), deque[HistoryPoint]()
    now = 1_000_000.0
    size_after_first = None
    for gap, point in steps:
        now += gap
        point = point.model_copy(update={"at": now})
        ring.append(point, capacity=capacity)
        ring.drop_before(now - HISTORY_S)
        size_after_first = size_after_first or ring.capacity
        expected.append(point)
        while expected and (expected[0].at < now - HISTORY_S or len(expected) > capacity):
            expected.popleft()
        assert list(ring) == list(expected)
        assert ring.capacity == size_after_first == capacity  # never grows
    cutoff = now - 60.0
    assert tuple(ring.since(cutoff)) == tuple(p for p in expected if p.at >= cutoff)
