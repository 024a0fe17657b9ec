"""One planning + placement round at the seed's production scale: 150 queues x 40 hosts x
3,500 slots. ``python -m bench.planner_bench`` prints JSON, writes bench/results/planner.json."""

from __future__ import annotations

import json
import random
import statistics
import time
from typing import Any

from bench.common import ROOT
from qcluster.manager.planning.placement import place
from qcluster.manager.planning.plan import QueueInput, QueueWindow, plan
from qcluster.policy import QueuePolicy

QUEUES, HOSTS, SLOTS = 150, 40, 3500


def make_policy(**fields: Any) -> QueuePolicy:
    """A validated policy (keywords checked at run time, as in qcluster.toml)."""
    return QueuePolicy.model_validate(fields)


def scenario(seed: int) -> tuple[list[QueueInput], dict[str, dict[str, int]], dict[str, int]]:
    rand = random.Random(seed)
    per_queue = SLOTS // QUEUES
    inputs = [
        QueueInput(f"q{i}", make_policy(priority=rand.randint(0, 10), min_slots=1,
                                        max_slots=200, batch_size=rand.choice([1, 10, 100])),
                   per_queue,
                   QueueWindow(processed=rand.randint(0, 100_000), busy_s=rand.uniform(0, 600),
                               alive_s=per_queue * 60.0, backlog=rand.randint(0, 50_000)))
        for i in range(QUEUES)
    ]
    hosts = [f"h{i}" for i in range(HOSTS)]
    current: dict[str, dict[str, int]] = {h: {} for h in hosts}
    for index, queue in enumerate(inputs):
        for k in range(queue.current):
            row = current[hosts[(index + k) % HOSTS]]
            row[queue.name] = row.get(queue.name, 0) + 1
    capacity = {h: SLOTS // HOSTS + 10 for h in hosts}
    return inputs, current, capacity


def one_round(inputs: list[QueueInput], current: dict[str, dict[str, int]],
              capacity: dict[str, int]) -> float:
    start = time.perf_counter()
    plans = plan(inputs, sum(capacity.values()))
    order = sorted(plans, key=lambda q: -plans[q].planned)
    place(current, {q: p.planned for q, p in plans.items()}, capacity, order)
    return (time.perf_counter() - start) * 1000


def run(rounds: int = 30) -> dict[str, Any]:
    times = [one_round(*scenario(seed)) for seed in range(rounds)]
    result = {"queues": QUEUES, "hosts": HOSTS, "slots": SLOTS, "rounds": rounds,
              "median_ms": statistics.median(times), "p95_ms": sorted(times)[int(0.95 * rounds)],
              "max_ms": max(times), "target_ms": 20.0}
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    (ROOT / "bench" / "results" / "planner.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
