"""The reconcile step as a pure function: desired row versus live slots -> actions.

Like a controller: idempotent, it only looks at the desired row (already clipped to
capacity) and the slots that exist; running it twice in a row gives no new action.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LiveSlot:
    slot_no: int
    queue: str
    idle: bool
    """Idle or starting: it has no batch to finish."""
    stopping: bool = False
    generation: int = 0
    """The code it was forked with (master/rollout.py replaces older ones)."""
    starting: bool = False
    """Forked, no hello yet."""


@dataclass(frozen=True)
class Fork:
    queue: str


@dataclass(frozen=True)
class Stop:
    slot_no: int


@dataclass(frozen=True)
class Switch:
    slot_no: int
    queue: str


Action = Fork | Stop | Switch


def clip_to_capacity(
    desired: Mapping[str, int], capacity: int, priorities: Mapping[str, int]
) -> dict[str, int]:
    """The row cut down to ``capacity`` slots, higher priority queues served first."""
    clipped: dict[str, int] = {}
    left = max(0, capacity)
    for queue in sorted(desired, key=lambda q: (-priorities.get(q, 0), q)):
        take = min(max(0, desired[queue]), left)
        clipped[queue] = take
        left -= take
    return clipped


def plan_actions(desired: Mapping[str, int], slots: Sequence[LiveSlot]) -> list[Action]:
    """Fork, stop, or move idle surplus slots to queues that lack slots (no fork needed)."""
    active = [s for s in slots if not s.stopping]
    by_queue: dict[str, list[LiveSlot]] = {}
    for slot in active:
        by_queue.setdefault(slot.queue, []).append(slot)
    surplus: list[LiveSlot] = []
    for queue, members in by_queue.items():
        extra = len(members) - desired.get(queue, 0)
        if extra > 0:
            # Idle slots go first: a busy one would have to finish its batch.
            members = sorted(members, key=lambda s: (not s.idle, -s.slot_no))
            surplus.extend(members[:extra])
    deficits = [
        (queue, want - len(by_queue.get(queue, [])))
        for queue, want in sorted(desired.items())
        if want > len(by_queue.get(queue, []))
    ]
    actions: list[Action] = []
    movable = [s for s in surplus if s.idle]
    for queue, missing in deficits:
        for _ in range(missing):
            if movable:
                slot = movable.pop(0)
                surplus.remove(slot)
                actions.append(Switch(slot.slot_no, queue))
            else:
                actions.append(Fork(queue))
    actions.extend(Stop(slot.slot_no) for slot in surplus)
    return actions
