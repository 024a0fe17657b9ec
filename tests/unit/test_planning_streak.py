"""The plan carries the planner's memory (``Streak``) of its need to the next round, field
for field: ``plan()`` spells the fields out rather than copying them by name (a copy by
name cost more than the rest of its loop), so a field added to ``Streak`` and not to the
plan would be lost between rounds. This test sees that."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from qcluster.manager.planning.plan import (
    STREAK_FIELDS,
    QueueInput,
    QueuePlan,
    QueueWindow,
    needed_slots,
    plan,
)
from qcluster.policy import QueuePolicy

TU = 0.8

rounds = st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 500), st.integers(0, 20)),
                  min_size=2, max_size=12)


@given(rounds, st.integers(0, 10), st.integers(0, 40))
def test_every_streak_field_of_the_need_reaches_the_plan(
        counts: list[tuple[int, int, int]], priority: int, capacity: int) -> None:
    policy = QueuePolicy.model_validate({"priority": priority, "min_slots": 0,
                                         "max_slots": 30, "est_job_seconds": 0.05})
    previous: QueuePlan | None = None
    seen: set[str] = set()
    for arrived, backlog, current in counts:
        window = QueueWindow(processed=arrived, busy_s=arrived * 0.05, alive_s=60.0 * current,
                             backlog=backlog, span_s=60.0, recent_s=2.0,
                             recent_arrived=arrived)
        queue = QueueInput("q", policy, current, window, previous=previous)
        need = needed_slots(queue, TU)
        previous = plan([queue], capacity, TU)["q"]
        for name in STREAK_FIELDS:
            assert getattr(previous, name) == getattr(need, name), name
            if getattr(need, name):
                seen.add(name)
    assert "work" in seen or not any(a for a, _, _ in counts)
