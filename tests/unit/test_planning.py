"""The planner's properties (shared/DESIGN.md section 5), each a hypothesis test."""

from __future__ import annotations

from typing import Any

from hypothesis import assume, given
from hypothesis import strategies as st

from manager.planning import QueueInput, QueueWindow, band_for, plan
from qcluster.policy import QueuePolicy

TU = 0.8


def make_policy(**fields: Any) -> QueuePolicy:
    """A validated policy (keywords checked at run time, as in qcluster.toml)."""
    return QueuePolicy.model_validate(fields)


@st.composite
def policies(draw: st.DrawFn) -> QueuePolicy:
    low = draw(st.integers(0, 5))
    high = draw(st.integers(low, low + 30))
    return make_policy(priority=draw(st.integers(-5, 20)), min_slots=low, max_slots=high,
                       batch_size=draw(st.sampled_from([1, 10, 100])),
                       est_job_seconds=draw(st.sampled_from([0.001, 0.05, 1.0])),
                       target_wait=draw(st.sampled_from([None, 0.5, 30.0])))


windows = st.builds(
    QueueWindow,
    processed=st.integers(0, 100_000),
    busy_s=st.floats(0, 500),
    alive_s=st.floats(0, 600),
    backlog=st.integers(0, 1_000_000),
)


@st.composite
def queue_inputs(draw: st.DrawFn, name: str = "q") -> QueueInput:
    policy = draw(policies())
    return QueueInput(name, policy, draw(st.integers(0, 40)), draw(windows))


BIG = 10_000


@given(queue_inputs())
def test_bounds_when_capacity_is_ample(queue: QueueInput) -> None:
    planned = plan([queue], BIG, TU)["q"].planned
    assert queue.policy.min_slots <= planned <= queue.policy.max_slots


@given(queue_inputs(), st.floats(-0.99, 0.99))
def test_hysteresis_keeps_slots_inside_the_band(queue: QueueInput, where: float) -> None:
    policy = queue.policy
    n = max(1, policy.min_slots)
    assume(n <= policy.max_slots)
    band = band_for(policy.priority)
    load = TU * (1 + where * band)
    window = QueueWindow(processed=1000, busy_s=load * 100.0, alive_s=100.0, backlog=0)
    planned = plan([QueueInput("q", policy, n, window)], BIG, TU)["q"].planned
    assert planned == n


def test_higher_priority_has_a_narrower_band() -> None:
    assert band_for(10) < band_for(0) < band_for(-5)


@given(queue_inputs(), st.integers(1, 1_000_000))
def test_more_backlog_never_means_fewer_slots(queue: QueueInput, more: int) -> None:
    more_work = QueueInput("q", queue.policy, queue.current, QueueWindow(
        queue.window.processed, queue.window.busy_s, queue.window.alive_s,
        queue.window.backlog + more))
    assert plan([more_work], BIG, TU)["q"].planned >= plan([queue], BIG, TU)["q"].planned


@given(queue_inputs())
def test_idle_queue_shrinks_towards_its_minimum(queue: QueueInput) -> None:
    idle = QueueInput("q", queue.policy, queue.current,
                      QueueWindow(processed=0, busy_s=0.0, alive_s=60.0, backlog=0))
    planned = plan([idle], BIG, TU)["q"].planned
    assert planned == queue.policy.min_slots or planned <= queue.current
    assert planned >= queue.policy.min_slots


@given(st.lists(queue_inputs(), min_size=2, max_size=6), st.integers(0, 60))
def test_scarcity_serves_minimums_then_priority(queues: list[QueueInput], capacity: int) -> None:
    queues = [QueueInput(f"q{i}", q.policy, q.current, q.window) for i, q in enumerate(queues)]
    plans = plan(queues, capacity, TU)
    total = sum(p.planned for p in plans.values())
    assert total <= max(capacity, 0)
    by_name = {q.name: q for q in queues}
    for a in plans.values():
        for b in plans.values():
            pa, pb = by_name[a.name].policy, by_name[b.name].policy
            if pa.priority > pb.priority and b.planned > min(pb.min_slots, b.needed):
                # b got more than its minimum: a must have all it needed.
                assert a.planned == a.needed
            if pa.priority > pb.priority and a.planned < min(pa.min_slots, a.needed):
                # a's minimum is not met: nothing was left for a lower priority.
                assert b.planned == 0
    if capacity >= sum(min(by_name[p.name].policy.min_slots, p.needed) for p in plans.values()):
        for p in plans.values():
            assert p.planned >= min(by_name[p.name].policy.min_slots, p.needed)


def test_backlog_without_measurements_starts_slots_in_batches() -> None:
    policy = make_policy(batch_size=100, max_slots=8)
    planned = plan([QueueInput("q", policy, 0, QueueWindow(backlog=550))], BIG, TU)["q"]
    assert planned.planned == 6 and "backlog 550" in planned.reason


def test_reason_carries_the_numbers() -> None:
    policy = make_policy(max_slots=50)
    window = QueueWindow(processed=1000, busy_s=100.0, alive_s=40.0, backlog=5000)
    decision = plan([QueueInput("mail", policy, 4, window)], BIG, TU)["mail"]
    assert decision.planned > 4
    assert decision.reason.startswith("mail: load ") and "backlog 5000" in decision.reason
    assert "4 -> " in decision.reason


def test_reason_reads_like_the_design_example() -> None:
    policy = make_policy(max_slots=50)  # priority 0: band ±30%
    window = QueueWindow(processed=1000, busy_s=100.0, alive_s=40.0, backlog=12000)
    reason = plan([QueueInput("mail", policy, 4, window)], BIG, TU)["mail"].reason
    assert reason.startswith("mail: load ")
    assert "> 104% (band ±30%)" in reason and ", backlog 12000, 4 -> " in reason
    assert reason.endswith(" slots")


@given(queue_inputs())
def test_paused_or_unservable_queue_gets_no_slot(queue: QueueInput) -> None:
    paused = QueueInput("q", queue.policy, queue.current, queue.window, paused=True)
    orphan = QueueInput("q", queue.policy, queue.current, queue.window, servable=False)
    assert plan([paused], BIG, TU)["q"].planned == 0
    decision = plan([orphan], BIG, TU)["q"]
    assert decision.planned == 0 and "served by no live host" in decision.reason


@given(st.lists(queue_inputs(), min_size=1, max_size=6), st.integers(0, 200))
def test_never_more_slots_than_the_cluster_has(queues: list[QueueInput], capacity: int) -> None:
    queues = [QueueInput(f"q{i}", q.policy, q.current, q.window) for i, q in enumerate(queues)]
    plans = plan(queues, capacity, TU)
    assert sum(p.planned for p in plans.values()) <= capacity
    for p in plans.values():
        assert 0 <= p.planned <= p.needed
