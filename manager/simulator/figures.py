"""The figures a policy is judged on, per queue and overall."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from qcluster.manager.simulator.engine import PolicyRun, QueueSim, SimulationResult

#: After a host dies, a queue's recovery is looked for within this many seconds.
RECOVERY_HORIZON_S = 600.0


def percentile(waits: Counter[int], fraction: float) -> int:
    """The wait (in steps) below which ``fraction`` of the jobs started; exact."""
    total = sum(waits.values())
    if not total:
        return 0
    rank = math.ceil(fraction * total)
    seen = 0
    for steps in sorted(waits):
        seen += waits[steps]
        if seen >= rank:
            return steps
    return max(waits)


def recovery(q: QueueSim, run: PolicyRun) -> list[dict[str, Any]]:
    """Per host death: seconds until the queue was last over its target wait, and that in
    planning rounds counted from when the manager noticed the death."""
    target = q.policy.target_wait
    if target is None:
        return []
    out = []
    for died in run.deaths:
        over = [t for t in q.over_target_at if died < t <= died + RECOVERY_HORIZON_S]
        back_s = (over[-1] - died) if over else 0.0
        after_notice = max(0.0, back_s - run.detect_s)
        out.append({"host_died_at_s": died, "back_within_target_s": round(back_s, 3),
                    "rounds_after_noticed": math.ceil(after_notice / run.interval_s - 1e-9)})
    return out


def slack(busy_s: float, provisioned_s: float) -> float:
    """The share of the slot-seconds provisioned that ran no job (0 when none were)."""
    if provisioned_s <= 0:
        return 0.0
    return round(max(0.0, 1 - busy_s / provisioned_s), 3)


def all_waits(q: QueueSim, run: PolicyRun) -> Counter[int]:
    """Waits of the jobs that started, and of those still waiting at the end (their wait
    so far: a starved queue must not look like one without waits)."""
    waits = Counter(q.waits)
    for at, count in q.buckets:
        waits[round((run.end_s - at) / run.step_s)] += count
    return waits


def queue_figures(q: QueueSim, run: PolicyRun) -> dict[str, Any]:
    step = run.step_s
    waits = all_waits(q, run)
    return {
        "priority": q.policy.priority,
        "target_wait_s": q.policy.target_wait,
        "jobs": q.arrived,
        "finished": q.finished,
        "wait_p50_s": percentile(waits, 0.50) * step,
        "wait_p99_s": percentile(waits, 0.99) * step,
        "wait_max_s": max(waits, default=0) * step,
        "unstarted": q.backlog,
        "max_backlog": q.max_backlog,
        "slot_seconds": round(q.slot_seconds, 1),
        "busy_slot_seconds": round(q.busy_seconds, 1),
        "slack": slack(q.busy_seconds, q.slot_seconds),
        "slot_moves": q.starts + q.stops,
        "plan_moves": len(q.plan_moves),
        "bursts": len(q.bursts),
        "burst_drain_max_s": round(max(q.bursts, default=0.0), 3),
        "burst_drain_mean_s": round(sum(q.bursts) / len(q.bursts), 3) if q.bursts else 0.0,
        "burst_drains_s": [round(b, 3) for b in q.bursts],
        "over_target_s": round(q.over_target_s, 3),
        "recovery": recovery(q, run),
    }


def overall(queues: dict[str, dict[str, Any]], run: PolicyRun) -> dict[str, Any]:
    waits: Counter[int] = Counter()
    for q in run.queues.values():
        waits.update(all_waits(q, run))
    rows = queues.values()
    return {
        "jobs": sum(r["jobs"] for r in rows),
        "finished": sum(r["finished"] for r in rows),
        "wait_p50_s": percentile(waits, 0.50) * run.step_s,
        "wait_p99_s": percentile(waits, 0.99) * run.step_s,
        "wait_max_s": max(waits, default=0) * run.step_s,
        "max_backlog": max((r["max_backlog"] for r in rows), default=0),
        "slot_seconds": round(sum(r["slot_seconds"] for r in rows), 1),
        "busy_slot_seconds": round(sum(q.busy_seconds for q in run.queues.values()), 1),
        "slack": slack(sum(q.busy_seconds for q in run.queues.values()),
                       sum(q.slot_seconds for q in run.queues.values())),
        "slot_moves": sum(r["slot_moves"] for r in rows),
        "plan_moves": sum(r["plan_moves"] for r in rows),
        "bursts": sum(r["bursts"] for r in rows),
        "burst_drain_max_s": max((r["burst_drain_max_s"] for r in rows), default=0.0),
        "over_target_s": round(sum(r["over_target_s"] for r in rows), 3),
        "over_capacity_rounds": run.over_capacity_rounds,
    }


def figures(result: SimulationResult) -> dict[str, Any]:
    """JSON-ready: per policy, per queue and overall."""
    out: dict[str, Any] = {"seed": result.seed, "duration_s": result.trace.duration_s,
                           "interval_s": result.trace.interval_s, "policies": {}}
    for name, run in result.runs.items():
        queues = {qn: queue_figures(q, run) for qn, q in run.queues.items()}
        out["policies"][name] = {"overall": overall(queues, run), "queues": queues}
    return out
