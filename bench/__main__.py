"""`make bench`: every suite in one run, systems alternating (A B C A B C ...), medians.

    python -m bench [--quick] [--only consume,enqueue,host,planner,memory,latency]
                    [--repeat N] [--jobs N]

Writes bench/results/latest.json and bench/results/latest.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

from bench import consume, master_bench, planner_bench, suites
from bench.common import ROOT, STATE_DIR, summary, versions

RESULTS = ROOT / "bench" / "results"
SUITES = ("consume", "enqueue", "host", "planner", "memory", "latency")


def alternate(systems: dict[str, Callable[[], float]], repeat: int) -> dict[str, Any]:
    runs: dict[str, list[float]] = {name: [] for name in systems}
    for round_no in range(repeat):
        for name, run in systems.items():
            value = run()
            runs[name].append(value)
            print(f"  [{round_no + 1}/{repeat}] {name}: {value:,.0f}/s", flush=True)
    return {name: summary(values) for name, values in runs.items()}


def ratio(table: dict[str, Any], a: str, b: str) -> float:
    return float(table[a]["median"] / table[b]["median"])


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    def check(what: str, value: float, goal: float, unit: str = "x", lower: bool = False) -> None:
        met = value <= goal if lower else value >= goal
        rows.append({"target": what, "value": round(value, 2), "goal": goal, "unit": unit,
                     "met": met})

    c = results.get("consume")
    if c:
        check("Redis batch 100 vs plain kombu consumer on Redis (issue 2)",
              ratio(c, "qcluster slot redis batch 100",
                    "kombu consumer redis, prefetch 100, ack each"), 25)
        check("RabbitMQ batch 100 vs kombu multiple-ack per 100 (the kombu limit)",
              ratio(c, "qcluster slot rabbitmq batch 100",
                    "kombu consumer rabbitmq, prefetch 100, multiple-ack per 100"), 0.8)
    h = results.get("host")
    if h:
        check("whole host, 2 slots, metrics on, embedded: jobs/s",
              sum(h["embedded"]["metrics_on"]) / len(h["embedded"]["metrics_on"]), 40_000, "/s")
        check("metrics overhead (embedded)", h["embedded"]["overhead"] * 100, 5, "%", lower=True)
    p = results.get("planner")
    if p:
        check("planner round, 150 queues x 40 hosts x 3,500 slots", p["median_ms"], 20, "ms",
              lower=True)
    m = results.get("memory")
    if m:
        check("8 slots of the 100 MB app: total PSS / one process", m["total_over_one_process"],
              2, "x", lower=True)
    lat = results.get("latency")
    if lat:
        check("enqueue-to-start p99 with idle slots", lat["p99_ms"], 50, "ms", lower=True)
    return rows


def markdown(results: dict[str, Any]) -> str:
    lines = [f"# Benchmark results ({results['date']})", "",
             f"Command: `{results['command']}`  ", f"Machine: {results['machine']}  ",
             f"Versions: {json.dumps(results['versions'])}", ""]
    for suite in ("consume", "enqueue"):
        if suite in results:
            lines += [f"## {suite}", "", "| system | median /s | min | max | runs |",
                      "|---|---:|---:|---:|---:|"]
            for name, s in results[suite].items():
                lines.append(f"| {name} | {s['median']:,.0f} | {s['min']:,.0f} | "
                             f"{s['max']:,.0f} | {s['runs']} |")
            lines.append("")
    for suite in ("host", "planner", "memory", "latency"):
        if suite in results:
            lines += [f"## {suite}", "", "```json", json.dumps(results[suite], indent=2), "```",
                      ""]
    lines += ["## Targets", "", "| target | value | goal | met |", "|---|---:|---:|---|"]
    for row in results["targets"]:
        verdict = "met" if row["met"] else "**MISSED**"
        lines.append(f"| {row['target']} | {row['value']:,} {row['unit']} | "
                     f"{row['goal']:,} {row['unit']} | {verdict} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("--quick", action="store_true", help="small counts, one round")
    parser.add_argument("--only", default=",".join(SUITES))
    parser.add_argument("--repeat", type=int, default=None)
    parser.add_argument("--jobs", type=int, default=None)
    args = parser.parse_args()
    repeat = args.repeat or (1 if args.quick else 3)
    jobs = args.jobs or (5_000 if args.quick else 50_000)
    only = set(args.only.split(","))
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(["python -m bench",
                                                                         *sys.argv[1:]]),
        "machine": f"{platform.node()} {platform.machine()}, {_cpus()} CPUs",
        "versions": versions(), "jobs": jobs, "repeat": repeat,
    }
    if "consume" in only:
        print("consume throughput, one process:", flush=True)
        results["consume"] = alternate(consume.systems(jobs), repeat)
    if "enqueue" in only:
        print("enqueue throughput:", flush=True)
        results["enqueue"] = alternate(suites.enqueue_systems(jobs // 5), repeat)
    if "host" in only:
        print("whole host (master, 2 slots):", flush=True)
        results["host"] = master_bench.run(5.0 if args.quick else 20.0)
    if "planner" in only:
        results["planner"] = planner_bench.run()
    if "memory" in only:
        print("memory of 8 slots:", flush=True)
        results["memory"] = suites.memory_of_slots()
    if "latency" in only:
        print("latency:", flush=True)
        results["latency"] = suites.latency(seconds=5.0 if args.quick else 10.0)
    from qcluster.broker.embedded import stop_embedded

    stop_embedded(STATE_DIR)  # the embedded broker the suites started
    results["targets"] = targets(results)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "latest.json").write_text(json.dumps(results, indent=2))
    (RESULTS / "latest.md").write_text(markdown(results))
    print(markdown(results))


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    main()
