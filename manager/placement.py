"""Where the planned slots run: the new slot map from the current one, pure.

Fewest moves: slots already placed stay where they are unless their queue shrank or
their host shrank; missing slots go to the host with the fewest slots of that queue
(spread), then the most free capacity. Hosts absent from ``capacity`` are dead: their
slots are dropped here and so re-placed on the live hosts in the same round.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

SlotMap = dict[str, dict[str, int]]


def _total(slot_map: Mapping[str, Mapping[str, int]], queue: str) -> int:
    return sum(row.get(queue, 0) for row in slot_map.values())


def _used(row: Mapping[str, int]) -> int:
    return sum(row.values())


def _trim_queue(slot_map: SlotMap, queue: str, excess: int) -> None:
    """Remove ``excess`` slots of ``queue``, each from the host holding the most."""
    for _ in range(excess):
        host = max(slot_map, key=lambda h: (slot_map[h].get(queue, 0), h))
        slot_map[host][queue] -= 1


def _trim_host(row: dict[str, int], capacity: int, order: Sequence[str]) -> None:
    """Bring a host within capacity, taking from the lowest priority, largest queues."""
    rank = {queue: index for index, queue in enumerate(order)}
    while _used(row) > capacity:
        queue = max((q for q in row if row[q] > 0), key=lambda q: (rank.get(q, 0), row[q]))
        row[queue] -= 1


def place(
    current: Mapping[str, Mapping[str, int]],
    planned: Mapping[str, int],
    capacity: Mapping[str, int],
    order: Sequence[str] | None = None,
) -> SlotMap:
    """host -> queue -> slots. ``order``: queues by priority, highest first."""
    order = list(order) if order is not None else sorted(planned)
    slot_map: SlotMap = {
        host: {q: n for q, n in current.get(host, {}).items() if q in planned and n > 0}
        for host in capacity
    }
    for queue, want in planned.items():
        excess = _total(slot_map, queue) - want
        if excess > 0:
            _trim_queue(slot_map, queue, excess)
    for host, row in slot_map.items():
        _trim_host(row, capacity[host], order)
    for queue in order:
        missing = planned.get(queue, 0) - _total(slot_map, queue)
        for _ in range(missing):
            free = [h for h in slot_map if _used(slot_map[h]) < capacity[h]]
            if not free:
                break
            host = min(free, key=lambda h: (
                slot_map[h].get(queue, 0), _used(slot_map[h]) - capacity[h], h))
            slot_map[host][queue] = slot_map[host].get(queue, 0) + 1
    return {host: {q: n for q, n in row.items() if n > 0} for host, row in slot_map.items()}
