"""Placement properties (shared/DESIGN.md section 5): capacity, fewest moves, spread,
a dead host re-planned in one round, slots only where the queue can run."""

from __future__ import annotations

from hypothesis import assume, given
from hypothesis import strategies as st

from qcluster.manager.planning.placement import SlotMap, place

HOSTS = ["h1", "h2", "h3", "h4"]
QUEUES = ["a", "b", "c"]

maps = st.dictionaries(st.sampled_from(HOSTS),
                       st.dictionaries(st.sampled_from(QUEUES), st.integers(0, 5)),
                       min_size=1)
plans = st.dictionaries(st.sampled_from(QUEUES), st.integers(0, 12))
capacities = st.dictionaries(st.sampled_from(HOSTS), st.integers(0, 10))


def total(slot_map: SlotMap, queue: str) -> int:
    return sum(row.get(queue, 0) for row in slot_map.values())


@given(maps, plans, capacities)
def test_placement_respects_capacity_and_plan(
    current: SlotMap, planned: dict[str, int], capacity: dict[str, int]
) -> None:
    result = place(current, planned, capacity)
    assert set(result) == set(capacity)
    for host, row in result.items():
        assert sum(row.values()) <= capacity[host]
    placed = sum(sum(r.values()) for r in result.values())
    assert placed == min(sum(planned.values()), sum(capacity.values()))
    for queue, want in planned.items():
        assert total(result, queue) <= want


@given(maps, st.dictionaries(st.sampled_from(HOSTS), st.integers(0, 30)))
def test_placement_keeps_a_map_that_already_fits(
    current: SlotMap, capacity: dict[str, int]
) -> None:
    current = {h: r for h, r in current.items() if h in capacity}
    assume(all(sum(r.values()) <= capacity[h] for h, r in current.items()))
    planned: dict[str, int] = {}
    for row in current.values():
        for q, n in row.items():
            planned[q] = planned.get(q, 0) + n
    result = place(current, planned, capacity)
    assert result == {h: {q: n for q, n in current.get(h, {}).items() if n} for h in capacity}


@given(maps, plans)
def test_fewest_moves_a_queue_only_grows_or_only_shrinks(
    current: SlotMap, planned: dict[str, int]
) -> None:
    """With room for the plan, a queue's slots change by exactly |planned - current|."""
    capacity = {h: 40 for h in current}
    current = {h: {q: n for q, n in r.items() if q in planned} for h, r in current.items()}
    result = place(current, planned, capacity)
    for queue, want in planned.items():
        moves = sum(abs(result[h].get(queue, 0) - current[h].get(queue, 0)) for h in capacity)
        assert moves == abs(want - total(current, queue))


@given(st.integers(1, 30), st.integers(2, 6))
def test_placement_spreads_a_queue_over_hosts(want: int, hosts: int) -> None:
    capacity = {f"h{i}": 100 for i in range(hosts)}
    result = place({}, {"a": want}, capacity)
    counts = [row.get("a", 0) for row in result.values()]
    assert max(counts) - min(counts) <= 1


@given(maps, plans)
def test_a_dead_host_is_replanned_in_one_round(
    current: SlotMap, planned: dict[str, int]
) -> None:
    capacity = {h: 40 for h in current}
    first = place(current, planned, capacity)
    dead = sorted(capacity)[0]
    survivors = {h: c for h, c in capacity.items() if h != dead}
    second = place(first, planned, survivors)
    assert dead not in second
    placed = sum(sum(r.values()) for r in second.values())
    assert placed == min(sum(planned.values()), sum(survivors.values()))
    for host in survivors:  # the survivors' slots stay where they were
        for queue, n in first[host].items():
            assert second[host].get(queue, 0) >= min(n, planned[queue])


@given(maps, plans, st.dictionaries(st.sampled_from(HOSTS), st.sets(st.sampled_from(QUEUES))))
def test_slots_go_only_to_hosts_that_serve_the_queue(
    current: SlotMap, planned: dict[str, int], serves: dict[str, set[str]]
) -> None:
    capacity = {h: 40 for h in current}
    result = place(current, planned, capacity, serves=serves)
    for host, row in result.items():
        assert set(row) <= serves.get(host, set())
    for queue, want in planned.items():
        servers = [h for h in capacity if queue in serves.get(h, set())]
        assert total(result, queue) == (want if servers else 0)
