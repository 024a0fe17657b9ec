"""One planning round's decision, pure: what the round observed goes in, the plans, the
new slot map and the decisions come out. No clock, no lock, no I/O.

``manager/service.py`` runs the round as observe -> decide -> act: it gathers a
:class:`RoundInput` (broker stats, then the state under its lock), calls :func:`decide`
outside the lock, and applies the :class:`RoundResult` (``ClusterState.apply``, the
decision log, the recorder).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from qcluster.manager.planning.placement import place
from qcluster.manager.planning.plan import QueueInput, QueuePlan, plan
from qcluster.messages import DecisionView
from qcluster.periodic import PeriodicSpec


@dataclass(frozen=True)
class RoundInput:
    """What one round plans from."""

    now: float
    queues: tuple[QueueInput, ...]
    """One per known queue, by name; each carries its previous plan."""
    capacity: Mapping[str, int]
    """Live host -> the slots it can run."""
    serves: Mapping[str, frozenset[str]]
    """Live host -> the queues its application declares."""
    base: Mapping[str, Mapping[str, int]]
    """The slot map placement starts from: the last one, or what runs before the first plan."""
    target_utilization: float


@dataclass(frozen=True)
class RoundResult:
    now: float
    plans: dict[str, QueuePlan]
    slot_map: dict[str, dict[str, int]]
    decisions: list[DecisionView]
    """The queues whose planned slots changed, in plan order (by name)."""


def next_ticks(specs: Iterable[PeriodicSpec], now: float) -> dict[str, float]:
    """Seconds from ``now`` to each queue's next periodic tick (the soonest of its jobs')."""
    now_ms = round(now * 1000)
    found: dict[str, float] = {}
    for spec in specs:
        try:
            seconds = (spec.next_tick(now_ms) - now_ms) / 1000
        except Exception:  # a schedule that cannot say: no pre-warm (the ticker warns)
            continue
        found[spec.queue] = min(seconds, found.get(spec.queue, seconds))
    return found


def with_ticks(round_input: RoundInput, next_ticks: Mapping[str, float]) -> RoundInput:
    """The round's input with each queue's seconds to its next periodic tick (the planner
    starts its slot a little before)."""
    if not next_ticks:
        return round_input
    queues = tuple(replace(q, next_tick_s=next_ticks[q.name]) if q.name in next_ticks else q
                   for q in round_input.queues)
    return replace(round_input, queues=queues)


def decide(round_input: RoundInput) -> RoundResult:
    """Plan every queue, place the plan on the live hosts, name each change."""
    queues = round_input.queues
    plans = plan(queues, sum(round_input.capacity.values()), round_input.target_utilization)
    order = [q.name for q in sorted(queues, key=lambda q: (-q.policy.priority, q.name))]
    slot_map = place(round_input.base, {name: p.planned for name, p in plans.items()},
                     round_input.capacity, order, round_input.serves)
    return RoundResult(now=round_input.now, plans=plans, slot_map=slot_map,
                       decisions=changes(queues, plans, round_input.now))


def changes(queues: tuple[QueueInput, ...], plans: Mapping[str, QueuePlan],
            now: float) -> list[DecisionView]:
    """A decision for each queue whose plan moved from its previous one (from what runs,
    on its first round)."""
    previous = {q.name: q.previous for q in queues}
    found = []
    for name, queue_plan in plans.items():
        before_plan = previous.get(name)
        before = before_plan.planned if before_plan is not None else queue_plan.current
        if queue_plan.planned != before:
            found.append(DecisionView.model_validate({
                "at": now, "queue": name, "from": before, "to": queue_plan.planned,
                "reason": queue_plan.reason,
            }))
    return found
