"""Where the planned slots run: the new slot map from the current one, pure.

Fewest moves: slots already placed stay where they are unless their queue shrank or
their host shrank; missing slots go to the host with the fewest slots of that queue
(spread), then the most free capacity. Hosts absent from ``capacity`` are dead: their
slots are dropped here and so re-placed on the live hosts in the same round. A slot
goes only to a host whose application declares its queue.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable, Mapping, Sequence

SlotMap = dict[str, dict[str, int]]


def _trim_queue(slot_map: SlotMap, used: dict[str, int], queue: str, excess: int) -> None:
    """Remove ``excess`` slots of ``queue``, each from the host holding the most."""
    heap = [(-row[queue], host) for host, row in slot_map.items() if row.get(queue, 0) > 0]
    heapq.heapify(heap)
    for _ in range(excess):
        count, host = heapq.heappop(heap)
        slot_map[host][queue] -= 1
        used[host] -= 1
        if count + 1 < 0:
            heapq.heappush(heap, (count + 1, host))


def _trim_host(row: dict[str, int], capacity: int, rank: Mapping[str, int]) -> int:
    """Bring a host within capacity, taking from the lowest priority, largest queues."""
    removed = 0
    while sum(row.values()) > capacity:
        queue = max((q for q in row if row[q] > 0), key=lambda q: (rank.get(q, 0), row[q]))
        row[queue] -= 1
        removed += 1
    return removed


def _add(slot_map: SlotMap, used: dict[str, int], capacity: Mapping[str, int], queue: str,
         missing: int, hosts: Iterable[str]) -> None:
    """Add ``missing`` slots of ``queue``: fewest of the queue first, then most free room."""
    heap = [(slot_map[h].get(queue, 0), used[h] - capacity[h], h)
            for h in hosts if used[h] < capacity[h]]
    heapq.heapify(heap)
    for _ in range(missing):
        if not heap:
            return
        count, _, host = heapq.heappop(heap)
        slot_map[host][queue] = count + 1
        used[host] += 1
        if used[host] < capacity[host]:
            heapq.heappush(heap, (count + 1, used[host] - capacity[host], host))


def place(
    current: Mapping[str, Mapping[str, int]],
    planned: Mapping[str, int],
    capacity: Mapping[str, int],
    order: Sequence[str] | None = None,
    serves: Mapping[str, Collection[str]] | None = None,
) -> SlotMap:
    """host -> queue -> slots. ``order``: queues by priority, highest first.

    ``serves``: host -> the queues its application declares; a slot is never placed on a
    host that cannot run its queue (the master would drop it). None: every host serves all.
    """
    order = list(order) if order is not None else sorted(planned)
    rank = {queue: index for index, queue in enumerate(order)}

    def can_serve(host: str, queue: str) -> bool:
        return serves is None or queue in serves.get(host, ())

    slot_map: SlotMap = {}
    for host in capacity:  # can_serve() inlined: every slot of every host, every round
        ok = serves.get(host, ()) if serves is not None else None
        slot_map[host] = {q: n for q, n in current.get(host, {}).items()
                          if q in planned and n > 0 and (ok is None or q in ok)}
    used = {host: sum(row.values()) for host, row in slot_map.items()}
    totals: dict[str, int] = {}
    for row in slot_map.values():
        for queue, n in row.items():
            totals[queue] = totals.get(queue, 0) + n
    for queue, want in planned.items():
        if totals.get(queue, 0) > want:
            _trim_queue(slot_map, used, queue, totals[queue] - want)
    for host, row in slot_map.items():
        if used[host] > capacity[host]:
            _trim_host(row, capacity[host], rank)
            used[host] = sum(row.values())
    placed_now: dict[str, int] = {}
    for row in slot_map.values():
        for queue, n in row.items():
            placed_now[queue] = placed_now.get(queue, 0) + n
    for queue in order:
        placed = placed_now.get(queue, 0)
        if planned.get(queue, 0) > placed:
            hosts = [h for h in slot_map if can_serve(h, queue)]
            _add(slot_map, used, capacity, queue, planned[queue] - placed, hosts)
    return {host: {q: n for q, n in row.items() if n > 0} for host, row in slot_map.items()}
