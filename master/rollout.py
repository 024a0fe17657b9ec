"""Rolling replacement of old-generation slots after a code reload, as a pure function.

While slots forked with older code remain, this takes over from ``reconcile.plan_actions``
(which would see a new slot and its old counterpart as one too many): per queue,

* a new-generation slot that has said hello retires one old slot of its queue (a
  graceful stop: it finishes and settles its batch, its read-ahead goes back uncharged),
  so the queue's ready slots (old + new, not stopping) never drop below its row;
* while old slots remain and nothing of the queue is in flight, one new slot is forked
  above the row. A replacement is in flight from that fork until the old slot it
  retires has exited: one per queue, at most ``in_flight_limit`` on the host, so the
  host never runs more than its row plus that many slots (a long batch being finished
  by a retiring slot holds its queue's next replacement back);
* scaling up forks new slots; scaling down stops old slots first, then new ones.

No switching between queues during a rollout: an old slot runs old code. Running it twice
gives no new action, like the reconcile step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from qcluster.master.reconcile import Action, Fork, LiveSlot, Stop, plan_actions

#: Share of the host's slots being replaced at once (at least one).
IN_FLIGHT_SHARE = 0.25


def in_flight_limit(desired: Mapping[str, int]) -> int:
    """Replacements in flight at once on a host running ``desired``: ~25%, at least 1."""
    return max(1, int(sum(max(0, n) for n in desired.values()) * IN_FLIGHT_SHARE))


def has_old(slots: Sequence[LiveSlot], generation: int) -> bool:
    return any(s.generation != generation for s in slots)


def plan_pass(desired: Mapping[str, int], slots: Sequence[LiveSlot],
              generation: int) -> list[Action]:
    """The decide step's actions: the rollout while older slots live, else reconcile."""
    if has_old(slots, generation):
        return plan_rollout(desired, slots, generation)
    return plan_actions(desired, slots)


def plan_rollout(desired: Mapping[str, int], slots: Sequence[LiveSlot], generation: int,
                 limit: int | None = None) -> list[Action]:
    """Actions for one pass while slots of another generation than ``generation`` live."""
    budget = in_flight_limit(desired) if limit is None else limit
    queues = sorted(set(desired) | {s.queue for s in slots if not s.stopping})
    plans = [_queue_plan(q, max(0, desired.get(q, 0)), slots, generation) for q in queues]
    budget -= sum(plan.in_flight for plan in plans)
    actions: list[Action] = []
    for plan in plans:
        actions.extend(plan.actions)
        if plan.wants_replacement and budget > 0:
            actions.append(Fork(plan.queue))
            budget -= 1
    return actions


class _QueuePlan:
    def __init__(self, queue: str) -> None:
        self.queue = queue
        self.actions: list[Action] = []
        self.in_flight = 0
        self.wants_replacement = False


def _queue_plan(queue: str, want: int, slots: Sequence[LiveSlot],
                generation: int) -> _QueuePlan:
    plan = _QueuePlan(queue)
    mine = [s for s in slots if s.queue == queue and not s.stopping]
    retiring = sum(1 for s in slots if s.queue == queue and s.stopping
                   and s.generation != generation)
    # Starting or idle old slots first (nothing to finish), then the youngest.
    old = sorted((s for s in mine if s.generation != generation),
                 key=lambda s: (not s.idle, -s.slot_no))
    new = [s for s in mine if s.generation == generation]
    ready = [s for s in new if not s.starting]
    retire = min(len(old), max(0, len(ready) + len(old) - want))
    plan.actions.extend(Stop(s.slot_no) for s in old[:retire])
    plan.in_flight = retiring + retire
    old_left = len(old) - retire
    surplus = len(new) + old_left - want
    if surplus < 0:
        plan.actions.extend(Fork(queue) for _ in range(-surplus))
    elif old_left and surplus == 0:
        plan.wants_replacement = not plan.in_flight
    elif old_left:  # new slots starting above the row: one is the replacement in flight
        plan.in_flight += 1
        starting = sorted((s for s in new if s.starting), key=lambda s: -s.slot_no)
        plan.actions.extend(Stop(s.slot_no) for s in starting[:surplus - 1])
    elif surplus > 0:  # no old slot left here: an ordinary surplus, idle ones first
        extra = sorted(new, key=lambda s: (not s.idle, -s.slot_no))[:surplus]
        plan.actions.extend(Stop(s.slot_no) for s in extra)
    return plan
