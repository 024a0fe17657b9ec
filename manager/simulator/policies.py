"""What decides the slots in a simulation: the manager's real planner, or a baseline.

Each policy sees what the manager would see at a planning round (one ``QueueInput`` per
queue, the capacity of the hosts it believes alive) and answers slots per queue.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Protocol

from qcluster.manager.planning.plan import QueueInput, QueuePlan, plan, share_capacity
from qcluster.manager.simulator.trace import Trace

POLICIES = ("qcluster", "hpa", "static")


class Policy(Protocol):
    name: str
    plans: dict[str, QueuePlan]
    """The previous round's plans, passed back to the planner (empty for baselines)."""

    def decide(self, at: float, inputs: Sequence[QueueInput], capacity: int) -> dict[str, int]:
        """Slots per queue for this round."""
        ...


class QclusterPolicy:
    """``manager.planning.plan.plan``, fed its previous round's plan as the manager does."""

    name = "qcluster"

    def __init__(self, trace: Trace) -> None:
        self.target_utilization = trace.target_utilization
        self.plans: dict[str, QueuePlan] = {}
        self.reasons: list[tuple[float, str]] = []

    def decide(self, at: float, inputs: Sequence[QueueInput], capacity: int) -> dict[str, int]:
        plans = plan(inputs, capacity, self.target_utilization)
        for name, new in plans.items():
            old = self.plans.get(name)
            if old is not None and old.planned != new.planned:
                self.reasons.append((at, new.reason))
        self.plans = plans
        return {name: p.planned for name, p in plans.items()}


#: The Kubernetes HPA rule's constants (as KEDA uses them on queue length).
HPA_TOLERANCE = 0.10
HPA_STABILIZATION_S = 300.0


class HpaPolicy:
    """Per queue, alone: ``desired = ceil(current x metric / target)`` for two metrics, the
    larger wins (as the HPA does with several): busy share of slot time against the
    target utilization, and backlog per slot against the jobs one slot runs within the
    queue's ``target_wait`` (30 s without one). Changes within 10% are ignored; a scale
    down takes the highest desired count of the last 300 s. No shared budget, no
    priorities: when the cluster is short, slots go first come, first served."""

    name = "hpa"

    def __init__(self, trace: Trace) -> None:
        self.plans: dict[str, QueuePlan] = {}
        self.target_utilization = trace.target_utilization
        self.history: dict[str, deque[tuple[float, int]]] = {}
        self.granted: dict[str, int] = {}
        self.waiting_since: dict[str, float] = {}

    def desired(self, queue: QueueInput) -> int:
        policy, window, current = queue.policy, queue.window, queue.current
        if current == 0:
            return max(policy.min_slots, 1 if window.backlog else 0)
        job_s = window.busy_s / window.processed if window.processed else policy.est_job_seconds
        share = window.busy_s / window.alive_s if window.alive_s > 0 else 0.0
        per_slot = max(1.0, (policy.target_wait or 30.0) / job_s)
        ratios = [share / self.target_utilization, window.backlog / current / per_slot]
        ratio = max(ratios)
        if abs(ratio - 1.0) <= HPA_TOLERANCE:
            return current
        return max(policy.min_slots, min(policy.max_slots, math.ceil(current * ratio)))

    def decide(self, at: float, inputs: Sequence[QueueInput], capacity: int) -> dict[str, int]:
        wanted: dict[str, int] = {}
        for queue in inputs:
            seen = self.history.setdefault(queue.name, deque())
            seen.append((at, self.desired(queue)))
            while seen and seen[0][0] < at - HPA_STABILIZATION_S:
                seen.popleft()
            wanted[queue.name] = max(d for _, d in seen)  # scale-down stabilization
        return self._first_come(at, wanted, capacity)

    def _first_come(self, at: float, wanted: Mapping[str, int], capacity: int) -> dict[str, int]:
        kept = {q: min(n, self.granted.get(q, 0)) for q, n in wanted.items()}
        left = capacity - sum(kept.values())
        if left < 0:  # capacity lost: every queue loses its share (as pods on a lost node)
            kept = self._lose_share(kept, -left)
            left = 0
        for q in wanted:
            if wanted[q] > kept[q]:
                self.waiting_since.setdefault(q, at)
            else:
                self.waiting_since.pop(q, None)
        for q in sorted(self.waiting_since, key=lambda q: (self.waiting_since[q], q)):
            more = min(wanted[q] - kept[q], max(0, left))
            kept[q] += more
            left -= more
        self.granted = kept
        return dict(kept)

    @staticmethod
    def _lose_share(kept: Mapping[str, int], lost: int) -> dict[str, int]:
        """Every queue gives back its share of ``lost`` slots: a dead host held about that
        share of each queue (placement spreads each queue over the hosts), and a lost node
        takes the pods of every deployment on it; the remainder, largest remainders first."""
        held = sum(kept.values())
        share = {q: n * lost // held for q, n in kept.items()}
        rest = lost - sum(share.values())
        for q in sorted(kept, key=lambda q: (-(kept[q] * lost % held), q))[:rest]:
            share[q] += 1
        return {q: n - share[q] for q, n in kept.items()}


class StaticPolicy:
    """Each queue provisioned once for its peak: the slots its highest arrival rate needs
    at the target utilization, within min/max; by priority when the cluster is short (as an
    operator sizing it by hand would)."""

    name = "static"

    def __init__(self, trace: Trace) -> None:
        self.plans: dict[str, QueuePlan] = {}
        from qcluster.manager.simulator.arrivals import peak_rate

        self.fixed: dict[str, int] = {}
        for name, spec in trace.queues.items():
            policy = spec.queue_policy()
            peak_job_s = max([spec.job_time.mean_s, *(m for _, m in spec.job_time.changes)])
            slots = math.ceil(peak_rate(spec, trace.interval_s) * peak_job_s
                              / trace.target_utilization)
            self.fixed[name] = max(policy.min_slots, min(policy.max_slots, slots))

    def decide(self, at: float, inputs: Sequence[QueueInput], capacity: int) -> dict[str, int]:
        wanted = {q.name: self.fixed.get(q.name, 0) for q in inputs}
        return share_capacity(wanted, {q.name: q.policy for q in inputs}, capacity)


def make_policy(name: str, trace: Trace) -> Policy:
    kinds: dict[str, type[QclusterPolicy] | type[HpaPolicy] | type[StaticPolicy]] = {
        "qcluster": QclusterPolicy, "hpa": HpaPolicy, "static": StaticPolicy}
    if name not in kinds:
        raise ValueError(f"unknown policy {name!r}: choose from {', '.join(POLICIES)}")
    return kinds[name](trace)
