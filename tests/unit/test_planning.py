"""The planner's properties (shared/DESIGN.md section 5), each a hypothesis test."""

from __future__ import annotations

from hypothesis import assume, given
from hypothesis import strategies as st

from manager.placement import place
from manager.planning import QueueInput, QueueWindow, band_for, plan
from qcluster.policy import QueuePolicy

TU = 0.8


@st.composite
def policies(draw: st.DrawFn) -> QueuePolicy:
    low = draw(st.integers(0, 5))
    high = draw(st.integers(low, low + 30))
    return QueuePolicy(priority=draw(st.integers(-5, 20)), min_slots=low, max_slots=high,
                       batch_size=draw(st.sampled_from([1, 10, 100])),
                       est_job_seconds=draw(st.sampled_from([0.001, 0.05, 1.0])))


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
    if capacity >= sum(min(by_name[p.name].policy.min_slots, p.needed) for p in plans.values()):
        for p in plans.values():
            assert p.planned >= min(by_name[p.name].policy.min_slots, p.needed)


def test_backlog_without_measurements_starts_slots_in_batches() -> None:
    policy = QueuePolicy(batch_size=100, max_slots=8)
    planned = plan([QueueInput("q", policy, 0, QueueWindow(backlog=550))], BIG, TU)["q"]
    assert planned.planned == 6 and "backlog 550" in planned.reason


def test_reason_carries_the_numbers() -> None:
    policy = QueuePolicy(max_slots=50)
    window = QueueWindow(processed=1000, busy_s=100.0, alive_s=40.0, backlog=5000)
    decision = plan([QueueInput("mail", policy, 4, window)], BIG, TU)["mail"]
    assert decision.planned > 4
    assert decision.reason.startswith("mail: load ") and "backlog 5000" in decision.reason
    assert "4 -> " in decision.reason


maps = st.dictionaries(st.sampled_from(["h1", "h2", "h3", "h4"]),
                       st.dictionaries(st.sampled_from(["a", "b", "c"]), st.integers(0, 5)),
                       min_size=1)


@given(maps, st.dictionaries(st.sampled_from(["a", "b", "c"]), st.integers(0, 12)),
       st.dictionaries(st.sampled_from(["h1", "h2", "h3", "h4"]), st.integers(0, 10)))
def test_placement_respects_capacity_and_plan(current, planned, capacity) -> None:  # type: ignore[no-untyped-def]
    result = place(current, planned, capacity)
    assert set(result) == set(capacity)
    for host, row in result.items():
        assert sum(row.values()) <= capacity[host]
    total_capacity = sum(capacity.values())
    placed = sum(sum(r.values()) for r in result.values())
    assert placed == min(sum(planned.values()), total_capacity)
    for queue, want in planned.items():
        assert sum(r.get(queue, 0) for r in result.values()) <= want


@given(maps, st.dictionaries(st.sampled_from(["h1", "h2", "h3", "h4"]), st.integers(0, 30)))
def test_placement_keeps_a_map_that_already_fits(current, capacity) -> None:  # type: ignore[no-untyped-def]
    current = {h: r for h, r in current.items() if h in capacity}
    assume(all(sum(r.values()) <= capacity[h] for h, r in current.items()))
    planned: dict[str, int] = {}
    for row in current.values():
        for q, n in row.items():
            planned[q] = planned.get(q, 0) + n
    result = place(current, planned, capacity)
    assert result == {h: {q: n for q, n in current.get(h, {}).items() if n} for h in capacity}


@given(st.integers(1, 30), st.integers(2, 6))
def test_placement_spreads_a_queue_over_hosts(want: int, hosts: int) -> None:
    capacity = {f"h{i}": 100 for i in range(hosts)}
    result = place({}, {"a": want}, capacity)
    counts = [row.get("a", 0) for row in result.values()]
    assert max(counts) - min(counts) <= 1


@given(maps, st.dictionaries(st.sampled_from(["a", "b", "c"]), st.integers(0, 12)))
def test_a_dead_host_is_replanned_in_one_round(current, planned) -> None:  # type: ignore[no-untyped-def]
    capacity = {h: 40 for h in current}
    first = place(current, planned, capacity)
    dead = sorted(capacity)[0]
    survivors = {h: c for h, c in capacity.items() if h != dead}
    second = place(first, planned, survivors)
    assert dead not in second
    placed = sum(sum(r.values()) for r in second.values())
    assert placed == min(sum(planned.values()), sum(survivors.values()))
