"""How many slots each queue needs: pure functions, no clock, no I/O.

For queue q over the window, with ``n`` current slots, ``P`` jobs processed, ``T_busy``
handler seconds, ``T_alive`` slot-alive seconds and ``B`` ready jobs now:

* ``t = T_busy / P`` (the policy's estimate while nothing was measured),
* ``load = (T_busy + B * t) / T_alive`` — above 1 when work waits (the seed's load),
* ``needed = ceil(n * load / target_utilization)``, raised so the backlog drains within
  the queue's ``target_wait`` when it has one, clamped to ``[min_slots, max_slots]``;
* hysteresis: ``n`` is kept while ``load / target_utilization`` stays within the
  priority's tolerance band (narrower for higher priorities: they react faster);
* a queue with backlog and no measurement yet starts with enough slots for its backlog
  in batches, capped by ``max_slots``;
* when the cluster's capacity is short: minimums first in priority order, then the rest
  in priority order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from qcluster.policy import QueuePolicy

#: Band half-width at priority 0; each priority step narrows it, within the limits.
BASE_BAND = 0.30
BAND_STEP = 0.02
MIN_BAND = 0.10
MAX_BAND = 0.50
#: Less slot time than this in the window is no measurement (the load would be noise).
MIN_ALIVE_S = 1.0


@dataclass(frozen=True)
class QueueWindow:
    """A queue's statistics over the planning window, summed over live hosts."""

    processed: int = 0
    busy_s: float = 0.0
    alive_s: float = 0.0
    backlog: int = 0


@dataclass(frozen=True)
class QueueInput:
    name: str
    policy: QueuePolicy
    current: int
    window: QueueWindow
    paused: bool = False
    servable: bool = True
    """False when no live host's application declares the queue: no slot could run it."""


@dataclass(frozen=True)
class QueuePlan:
    name: str
    current: int
    needed: int
    """What the queue asks for, before the cluster's capacity is shared out."""
    planned: int
    load: float
    band: float
    mean_job_s: float
    reason: str


def band_for(priority: int) -> float:
    """Tolerance around the target utilization; narrower for higher priority."""
    return min(MAX_BAND, max(MIN_BAND, BASE_BAND - BAND_STEP * priority))


def mean_job_seconds(window: QueueWindow, policy: QueuePolicy) -> float:
    if window.processed > 0 and window.busy_s > 0:
        return window.busy_s / window.processed
    return policy.est_job_seconds


def queue_load(window: QueueWindow, policy: QueuePolicy) -> float:
    """(busy time + estimated backlog time) / slot time; inf when work waits and no slot ran."""
    work = window.busy_s + window.backlog * mean_job_seconds(window, policy)
    if window.alive_s <= 0:
        return math.inf if work > 0 else 0.0
    return work / window.alive_s


def _clamp(value: int, policy: QueuePolicy) -> int:
    return max(policy.min_slots, min(policy.max_slots, value))


def needed_slots(queue: QueueInput, target_utilization: float) -> tuple[int, float, str]:
    """(needed slots, load, why) for one queue, ignoring the other queues."""
    policy, window, n = queue.policy, queue.window, queue.current
    load = queue_load(window, policy)
    band = band_for(policy.priority)
    if queue.paused:
        return 0, load, "paused"
    if not queue.servable:
        return 0, load, "served by no live host"
    if window.alive_s < MIN_ALIVE_S:
        batches = math.ceil(window.backlog / policy.batch_size)
        needed = _clamp(max(n, batches), policy)
        return needed, load, f"backlog {window.backlog} in batches of {policy.batch_size}"
    ratio = load / target_utilization
    in_band = abs(ratio - 1.0) <= band and n > 0 and policy.min_slots <= n <= policy.max_slots
    if in_band:
        needed, why = n, f"load {load:.0%} within {target_utilization:.0%} ±{band:.0%}"
    else:
        side = ">" if ratio > 1 else "<"
        edge = target_utilization * (1 + band if ratio > 1 else 1 - band)
        wanted = max(n, 1) * ratio
        needed = policy.max_slots if wanted >= policy.max_slots else math.ceil(wanted)
        why = f"load {load:.0%} {side} {edge:.0%} (band ±{band:.0%})"
    t = mean_job_seconds(window, policy)
    if policy.target_wait and window.backlog:
        drain = math.ceil(window.backlog * t / policy.target_wait)
        if drain > needed:
            needed, why = drain, f"{why}; backlog drains within {policy.target_wait:g}s"
    return _clamp(needed, policy), load, why


def share_capacity(
    needs: Mapping[str, int], policies: Mapping[str, QueuePolicy], capacity: int,
    paused: frozenset[str] = frozenset(),
) -> dict[str, int]:
    """Minimums first in priority order, then the rest of each need in priority order."""
    order = sorted(needs, key=lambda q: (-policies[q].priority, q))
    left = max(0, capacity)
    granted = dict.fromkeys(order, 0)
    for queue in order:
        floor = 0 if queue in paused else min(policies[queue].min_slots, needs[queue])
        floor = max(floor, 0)
        granted[queue] = min(floor, left)
        left -= granted[queue]
    for queue in order:
        more = min(needs[queue] - granted[queue], left)
        if more > 0:
            granted[queue] += more
            left -= more
    return granted


def plan(
    queues: Sequence[QueueInput], capacity: int, target_utilization: float = 0.8
) -> dict[str, QueuePlan]:
    """Every queue's planned slots for this round, each with a reason."""
    needs: dict[str, int] = {}
    loads: dict[str, float] = {}
    whys: dict[str, str] = {}
    for queue in queues:
        needs[queue.name], loads[queue.name], whys[queue.name] = needed_slots(
            queue, target_utilization
        )
    policies = {q.name: q.policy for q in queues}
    paused = frozenset(q.name for q in queues if q.paused)
    granted = share_capacity(needs, policies, capacity, paused)
    plans = {}
    for queue in queues:
        got, need = granted[queue.name], needs[queue.name]
        why = whys[queue.name]
        if got < need:
            why += f"; capacity short: {got} of {need} needed"
        reason = (
            f"{queue.name}: {why}, backlog {queue.window.backlog}, "
            f"{queue.current} -> {got} slots"
        )
        plans[queue.name] = QueuePlan(
            name=queue.name, current=queue.current, needed=need, planned=got,
            load=loads[queue.name], band=band_for(queue.policy.priority),
            mean_job_s=mean_job_seconds(queue.window, queue.policy), reason=reason,
        )
    return plans
