"""Writes the generated example traces: ``python examples/traces/generate.py``.

diurnal.json: a day compressed into 24 minutes (one simulated minute per hour), four
queues whose rates follow the day with their own peaks. cold_start_40.json, quiet_queues.json,
periodic.json, diurnal_slack.json: many queues from cold, quiet queues, periodic jobs, and
a day of six queues on which slack is judged; diurnal_day.json: the same six queues over a
real day, sized by their wait. large_150x40.json: the seed's
scale, 150 queues on 40 hosts over a real 24 h, each queue's rate following the day,
planned every 10 s (the benchmark ``python -m bench --only simulator`` runs it).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent


def day_curve(peak: float, peak_hour: float, seconds_per_hour: float,
              night_share: float = 0.1) -> list[list[float]]:
    """[[at_s, rate], ...] hourly: ``night_share`` of the peak at night, a smooth day."""
    points = []
    for hour in range(25):
        distance = min(abs(hour - peak_hour), 24 - abs(hour - peak_hour))
        share = night_share + (1 - night_share) * max(0.0, math.cos(distance / 12 * math.pi)) ** 2
        points.append([hour * seconds_per_hour, round(peak * share, 2)])
    return points


def diurnal() -> dict[str, Any]:
    spec = [("api", 10, 2, 600, 0.02, 14), ("thumbs", 5, 10, 300, 0.05, 20),
            ("mail", 1, 30, 120, 0.05, 9), ("export", 0, None, 20, 0.5, 3)]
    queues = {}
    for name, priority, target, peak, job_s, hour in spec:
        policy: dict[str, Any] = {"priority": priority, "max_slots": 60}
        if target:
            policy["target_wait"] = target
        queues[name] = {"policy": policy, "rate": day_curve(peak, hour, 60.0),
                        "shape": "linear", "job_time": {"mean_s": job_s}}
    # Planned for 70% busy: at the default 80% the day's p99 wait is one step (0.5 s)
    # where static, sized for the peak, has none; both policies size to this target.
    return {"duration_s": 1440, "target_utilization": 0.7,
            "hosts": {f"h{i}": {"slots": 20} for i in range(4)}, "queues": queues}


def large(seed: int = 14) -> dict[str, Any]:
    rand = random.Random(seed)
    queues = {}
    for i in range(150):
        job_s = rand.choice([0.005, 0.02, 0.05, 0.1, 0.2])
        slots_at_peak = rand.uniform(2, 30)
        policy: dict[str, Any] = {"priority": rand.randint(0, 10), "min_slots": rand.choice([0, 1]),
                                  "max_slots": 60, "batch_size": rand.choice([1, 10, 100])}
        if rand.random() < 0.5:
            policy["target_wait"] = rand.choice([5, 30, 120])
        queues[f"q{i:03d}"] = {
            "policy": policy,
            "rate": day_curve(round(slots_at_peak * 0.7 / job_s, 1), rand.uniform(0, 24), 3600.0),
            "shape": "linear", "job_time": {"mean_s": job_s}}
    # At this scale the manager plans every 10 s ([manager] interval_s = 10): a round of
    # 150 queues costs ~1 ms of planning, and a simulated day of 2 s rounds is 43,200 of them.
    return {"duration_s": 86400, "interval_s": 10.0, "step_s": 10.0,
            "hosts": {f"h{i:02d}": {"slots": 90} for i in range(40)}, "queues": queues,
            "events": [{"at_s": 30000, "host": "h07", "event": "die"},
                       {"at_s": 33600, "host": "h07", "event": "return"}]}


def cold_start(seed: int = 27) -> dict[str, Any]:
    """Forty queues with flat rates start at once from zero slots (a first deploy, a full
    outage) on ten hosts of 16 slots; their work at the target utilization is about 56% of
    the slots."""
    rand = random.Random(seed)
    queues = {}
    for i in range(40):
        job_s = rand.choice([0.02, 0.05, 0.1, 0.2, 0.5])
        work = rand.uniform(0.5, 3.1)  # slot-seconds per second: 72 in all, on average
        policy: dict[str, Any] = {"priority": rand.randint(0, 9), "max_slots": 40,
                                  "batch_size": rand.choice([1, 10, 50])}
        if rand.random() < 0.6:
            policy["target_wait"] = rand.choice([5, 10, 30])
        queues[f"c{i:02d}"] = {"policy": policy, "rate": [[0.0, round(work / job_s, 2)]],
                               "job_time": {"mean_s": job_s}}
    return {"duration_s": 900, "hosts": {f"h{i}": {"slots": 16} for i in range(10)},
            "queues": queues}


def quiet(seed: int = 28) -> dict[str, Any]:
    """Twenty quiet queues, a job every 2 to 30 s each, for half an hour."""
    rand = random.Random(seed)
    queues = {}
    for i in range(20):
        every = rand.uniform(2.0, 30.0)
        policy: dict[str, Any] = {"priority": rand.randint(0, 5)}
        if rand.random() < 0.5:
            policy["target_wait"] = rand.choice([5, 10, 30])
        queues[f"q{i:02d}"] = {"policy": policy, "rate": [[0.0, round(1 / every, 4)]],
                               "job_time": {"mean_s": rand.choice([0.05, 0.2, 0.5])}}
    return {"duration_s": 1800, "hosts": {f"h{i}": {"slots": 16} for i in range(2)},
            "queues": queues}


def periodic() -> dict[str, Any]:
    """Periodic jobs beside a steady queue: a report of 20 two-second jobs every 15
    minutes (ticks further apart than a queue's idle period), a cleanup every minute."""
    queues = {
        "reports": {"policy": {"target_wait": 30}, "every_s": 900.0, "tick_jobs": 20,
                    "job_time": {"mean_s": 2.0}},
        "cleanup": {"policy": {"target_wait": 10}, "every_s": 60.0,
                    "job_time": {"mean_s": 0.5}},
        "api": {"policy": {"priority": 5, "target_wait": 2}, "rate": [[0.0, 40.0]],
                "job_time": {"mean_s": 0.05}},
    }
    return {"duration_s": 3600, "hosts": {"h0": {"slots": 16}}, "queues": queues}


def diurnal_slack(seconds_per_hour: float = 60.0, size_by: str | None = None) -> dict[str, Any]:
    """A day of six queues (one simulated minute per hour) at the default target
    utilization, each with a target wait: the trace slack is judged on. ``size_by``: the
    queues' policy field, when given."""
    spec = [("api", 9, 2, 600, 0.02, 14), ("search", 7, 2, 300, 0.03, 11),
            ("thumbs", 5, 10, 200, 0.05, 20), ("mail", 3, 30, 120, 0.05, 9),
            ("index", 1, 60, 40, 0.2, 16), ("export", 0, 120, 12, 0.5, 3)]
    queues = {}
    for name, priority, target, peak, job_s, hour in spec:
        policy: dict[str, Any] = {"priority": priority, "max_slots": 60, "target_wait": target}
        if size_by:
            policy["size_by"] = size_by
        queues[name] = {"policy": policy, "rate": day_curve(peak, hour, seconds_per_hour),
                        "shape": "linear", "job_time": {"mean_s": job_s}}
    return {"duration_s": round(24 * seconds_per_hour),
            "hosts": {f"h{i}": {"slots": 20} for i in range(4)}, "queues": queues}


def diurnal_day() -> dict[str, Any]:
    """diurnal_slack's six queues over a real day (86,400 s), each sized by its wait
    (``size_by = "wait"``): the trace the sizing by wait is judged on."""
    return diurnal_slack(seconds_per_hour=3600.0, size_by="wait")


def main() -> None:
    for name, trace in (("diurnal", diurnal()), ("large_150x40", large()),
                        ("cold_start_40", cold_start()), ("quiet_queues", quiet()),
                        ("periodic", periodic()), ("diurnal_slack", diurnal_slack()),
                        ("diurnal_day", diurnal_day())):
        (HERE / f"{name}.json").write_text(json.dumps(trace, indent=1) + "\n")


if __name__ == "__main__":
    main()
