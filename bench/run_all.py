"""Every suite in one run (``python -m bench``, whose arguments bench/__main__.py reads
first), systems alternating (A B C A B C ...), medians; the targets and latest.md.

Importing this module starts the private brokers (bench/common.py).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from bench import (
    async_bench,
    consume,
    fleet,
    master_bench,
    peer_runs,
    planner_bench,
    retention_bench,
    shards_bench,
    sim_bench,
    sim_vs_real,
    slot_memory,
    suites,
)
from bench.common import ROOT, STATE_DIR, summary, versions

RESULTS = ROOT / "bench" / "results"
QCLUSTER_MEMORY = "qcluster master --slots Q=8"


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


REDIS_B100, REDIS_B1 = "qcluster slot redis batch 100", "qcluster slot redis batch 1"
RABBIT_B100 = "qcluster slot rabbitmq batch 100"
CELERY_SOLO_REDIS = "Celery solo, redis"
DRAMATIQ_REDIS = "Dramatiq 1 process 1 thread, {}, redis"
DRAMATIQ_RABBIT = "Dramatiq 1 process 1 thread, prefetch 100, rabbitmq"
#: (what, system, against, at least this many times)
CONSUME_TARGETS = [
    ("Redis batch 100 vs Dramatiq prefetch 100", REDIS_B100,
     DRAMATIQ_REDIS.format("prefetch 100"), 30),
    ("Redis batch 100 vs Celery solo", REDIS_B100, CELERY_SOLO_REDIS, 25),
    ("Redis batch 1 vs Celery solo", REDIS_B1, CELERY_SOLO_REDIS, 2),
    ("Redis batch 1 vs Dramatiq default", REDIS_B1, DRAMATIQ_REDIS.format("default prefetch"),
     1),
    ("RabbitMQ batch 100 vs Dramatiq prefetch 100", RABBIT_B100, DRAMATIQ_RABBIT, 4),
    ("RabbitMQ batch 100 vs kombu multiple-ack per 100 (the kombu limit)", RABBIT_B100,
     "kombu consumer rabbitmq, prefetch 100, multiple-ack per 100", 1.5),
    ("Redis batch 100 vs plain kombu consumer on Redis", REDIS_B100,
     "kombu consumer redis, prefetch 100, ack each", 25),
]


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    def check(what: str, value: float, goal: float | None, unit: str = "x",
              lower: bool = False) -> None:
        """A row of the targets table; ``goal=None`` is a figure shown without a target."""
        met = None if goal is None else (value <= goal if lower else value >= goal)
        rows.append({"target": what, "value": round(value, 2), "goal": goal, "unit": unit,
                     "met": met})

    c = results.get("consume")
    if c:
        for what, a, b, goal in CONSUME_TARGETS:
            if a in c and b in c:
                check(what, ratio(c, a, b), goal)
    h = results.get("host")
    if h:
        for backend in ("embedded", "redis"):
            run = h[backend]["metrics_on"]
            dry = " (the queue ran dry: the producer was the limit)" if run.get(
                "lowest_ready", 1) == 0 else ""
            check(f"whole host, 2 slots, metrics on, {backend}: jobs/s{dry}", run["jobs_per_s"],
                  40_000 if backend == "embedded" else None, "/s")
        alone = h.get("redis_no_producer")
        if alone:
            dry = " (the queue ran dry)" if alone["lowest_ready"] == 0 else ""
            check(f"whole host, 2 slots, metrics on, redis, every job queued beforehand (no "
                  f"producer in the window): jobs/s{dry}", alone["jobs_per_s"], 80_000, "/s")
        for backend in ("embedded", "redis"):
            pairs = len(h[backend]["slot_cpu_us_per_job"]["on"])
            check(f"metrics overhead: slot CPU per job, on vs off side by side, median of {pairs}"
                  f" ({backend})",
                  h[backend]["cpu_overhead"] * 100, 5, "%", lower=True)
            check(f"metrics overhead: recording cost alone (micro-benchmark) / slot CPU per job"
                  f" ({backend})", h[backend]["recording_overhead"] * 100, None, "%")
            check(f"metrics overhead: jobs/s of the saturated 2-core host ({backend})",
                  h[backend]["rate_overhead"] * 100, None, "%")
    p = results.get("planner")
    if p:
        check("planner round, 150 queues x 40 hosts x 3,500 slots", p["median_ms"], 20, "ms",
              lower=True)
    sim = results.get("simulator")
    if sim:
        check("simulate 24 h, 150 queues x 40 hosts, one core (CPU s)", sim["cpu_s"],
              sim["target_s"], "s", lower=True)
    simreal = results.get("simreal")
    if simreal:
        for key, goal in simreal["targets"].items():
            worst = max((abs(row["error"][key] or 0.0) for row in simreal["queues"].values()),
                        default=0.0)
            what = f"simulated vs real demo run, worst queue's {key} error"
            check(what, worst * 100, goal * 100, "%", lower=True)
            # Met when every queue is within (is_within: 0 on both sides agrees).
            rows[-1]["met"] = all(queue[key] for queue in simreal["within"].values())
    m = results.get("memory")
    if m:
        check("8 slots of the 100 MB app: total PSS / one process",
              m[QCLUSTER_MEMORY]["total_over_one_process"], 2, "x", lower=True)
        noop = m[QCLUSTER_MEMORY].get("noop_slot")
        if noop:
            check("a no-op slot's PSS, idle (8 slots)", noop["idle"]["pss_mib"],
                  noop["target_pss_mib"], "MiB", lower=True)
            check("a no-op slot's Private_Dirty after 25,000 jobs",
                  noop["after_jobs"]["private_dirty_mib"], noop["target_private_dirty_mib"],
                  "MiB", lower=True)
    lat = results.get("latency")
    if lat:
        check("enqueue-to-start p99 with idle slots", lat["p99_ms"], 50, "ms", lower=True)
    shards = results.get("shards")
    if shards:
        one, many = shards["median"].values()
        check(f"{shards_bench.SHARDS}-shard Redis Cluster vs one Redis, whole host, 6 queues: "
              f"jobs/s ratio (broker CPU share {many['broker_cpu_share']} vs "
              f"{one['broker_cpu_share']} of a core)", shards["gain"], None)
    for check_row in (results.get("fleet") or {}).get("targets", []):
        what, bound = check_row["what"], float(check_row["target"].split()[1])
        unit = "ms" if "(ms)" in what else "s" if "(s)" in what else "KiB" if "KiB" in what \
            else "of a core"
        check(f"live fleet: {what}", check_row["value"] if check_row["value"] is not None
              else float("nan"), bound, unit, lower=True)
    kept = results.get("retention")
    if kept:
        check("finished-job records (keep_finished_s=300 vs 0): slot+Redis CPU per job, "
              "batch 100, Redis", kept["finished_records_overhead"] * 100, 5, "%", lower=True)
        check("failure path: slot+Redis CPU per job of a raising handler, over a no-op (us)",
              kept["failure_path_us_per_job"], None, "us")
    aio = results.get("async")
    if aio and async_bench.ARQ_ROW in aio:
        check("async handler, 10 ms await per job, batch/concurrency 100 vs arq max_jobs 100",
              ratio(aio, async_bench.QCLUSTER_ROW, async_bench.ARQ_ROW), None)
    return rows


def markdown(results: dict[str, Any]) -> str:
    lines = [f"# Benchmark results ({results['date']})", "",
             f"Command: `{results['command']}`  ", f"Machine: {results['machine']}  ",
             f"Versions: {json.dumps(results['versions'])}  "]
    seconds = results.get("seconds")
    if seconds:
        lines.append("Run time: " + ", ".join(f"{name} {value:.0f} s"
                                              for name, value in seconds.items()))
    lines.append("")
    for suite in ("consume", "enqueue", "async"):
        if suite in results:
            lines += _rate_table(suite, results[suite])
    if "memory" in results:
        lines += _memory_table(results["memory"])
    if "fleet" in results:
        lines += fleet.markdown_rows(results["fleet"]["rows"])
    for suite in ("host", "planner", "simulator", "simreal", "latency", "shards"):
        if suite in results:
            lines += [f"## {suite}", "", "```json", json.dumps(results[suite], indent=2), "```",
                      ""]
    lines += ["## Targets", "", "| target | value | goal | met |", "|---|---:|---:|---|"]
    for row in results["targets"]:
        verdict = {True: "met", False: "**MISSED**", None: "(no target)"}[row["met"]]
        goal = "" if row["goal"] is None else f"{row['goal']:,} {row['unit']}"
        lines.append(f"| {row['target']} | {row['value']:,} {row['unit']} | {goal} | {verdict} |")
    lines += ["", "## Commands", "", "| system | command |", "|---|---|"]
    lines += [f"| {name} | `{command}` |" for name, command in results["commands"].items()]
    return "\n".join(lines) + "\n"


def _rate_table(suite: str, table: dict[str, Any]) -> list[str]:
    """Fastest first, each with its ratio to Celery solo on the same broker."""
    lines = [f"## {suite}", "", "| system | median /s | min | max | runs | vs Celery solo |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, s in sorted(table.items(), key=lambda item: -item[1]["median"]):
        broker = "rabbitmq" if "rabbitmq" in name else "redis"
        celery = table.get(f"Celery solo, {broker}")
        versus = f"{s['median'] / celery['median']:.1f}x" if celery else ""
        lines.append(f"| {name} | {s['median']:,.0f} | {s['min']:,.0f} | {s['max']:,.0f} | "
                     f"{s['runs']} | {versus} |")
    return [*lines, ""]


def _memory_table(memory: dict[str, Any]) -> list[str]:
    lines = ["## memory (8 workers of an app that allocates 100 MB at import)", "",
             "| system | workers | PSS per worker (MiB) | USS per worker (MiB) | total PSS (MiB) "
             "| one process (MiB) | total / one process |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, m in memory.items():
        lines.append(f"| {name} | {m['workers']} | {statistics.median(m['worker_pss_mib'])} | "
                     f"{statistics.median(m['worker_uss_mib'])} | {m['total_pss_mib']} | "
                     f"{m['one_process_pss_mib']} | {m['total_over_one_process']}x |")
    noop = memory.get(QCLUSTER_MEMORY, {}).get("noop_slot")
    if noop:
        idle, busy = noop["idle"], noop["after_jobs"]
        lines += ["", f"A no-op slot ({noop['slots']} slots, app allocating nothing): PSS "
                  f"{idle['pss_mib']} MiB idle, {busy['pss_mib']} after {noop['jobs_each']:,} "
                  f"jobs each; Private_Dirty {idle['private_dirty_mib']} MiB idle, "
                  f"{busy['private_dirty_mib']} after.", ""]
    return [*lines, ""]


def main(args: argparse.Namespace) -> None:
    """The run ``args`` (bench/__main__.py's) ask for."""
    if args.render:
        rerender()
        return
    started = time.monotonic()
    repeat = args.repeat or (1 if args.quick else 3)
    jobs = args.jobs or (5_000 if args.quick else 50_000)
    peer_jobs = args.peer_jobs or (5_000 if args.quick else 20_000)
    peers = not args.no_peers
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(["python -m bench", *sys.argv[1:]]),
        "machine": f"{platform.node()} {platform.machine()}, {_cpus()} CPUs",
        "versions": versions(), "jobs": jobs, "peer_jobs": peer_jobs, "repeat": repeat,
        "peer_window_s": peer_runs.WINDOW_S,
        "commands": {**consume.commands(), **async_bench.commands()},
        "seconds": {},
    }
    if peers:
        print("peers:", flush=True)
        results["versions"].update(peer_runs.ensure_peers())
        results["commands"].update(peer_runs.commands())
    suites_to_run = _suites(args, repeat, jobs, peer_jobs, peers)
    for name in args.only.split(","):
        suite_started = time.monotonic()
        results[name] = suites_to_run[name]()
        results["seconds"][name] = round(time.monotonic() - suite_started, 1)
        print(f"{name}: {results['seconds'][name]:.0f} s", flush=True)
    from qcluster.broker.embedded import stop_embedded

    stop_embedded(STATE_DIR)  # the embedded broker the suites started
    results["seconds"]["total"] = round(time.monotonic() - started, 1)
    results["targets"] = targets(results)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "latest.json").write_text(json.dumps(results, indent=2))
    (RESULTS / "latest.md").write_text(markdown(results))
    print(markdown(results))


def _suites(args: argparse.Namespace, repeat: int, jobs: int, peer_jobs: int, peers: bool
            ) -> dict[str, Callable[[], Any]]:
    """Each suite as a call that returns its results (peers included unless ``peers`` is off)."""

    def consume_suite() -> dict[str, Any]:
        print("consume throughput, one process:", flush=True)
        systems = consume.systems(jobs, peer_jobs)
        if peers:
            systems.update(peer_runs.consume_systems(peer_jobs))
        return alternate(systems, repeat)

    def enqueue_suite() -> dict[str, Any]:
        print("enqueue throughput:", flush=True)
        systems = suites.enqueue_systems(jobs // 10)
        if peers:
            systems.update(peer_runs.enqueue_systems(2_000))
        return alternate(systems, repeat)

    def host_suite() -> dict[str, Any]:
        print("whole host (master, 2 slots):", flush=True)
        return master_bench.run(10.0 if args.quick else 60.0)

    def memory_suite() -> dict[str, Any]:
        print("memory of 8 workers:", flush=True)
        memory = {QCLUSTER_MEMORY: suites.memory_of_slots()}
        memory[QCLUSTER_MEMORY]["noop_slot"] = slot_memory.noop_slot_memory()
        if peers:
            memory.update(peer_runs.memory())
        return memory

    def latency_suite() -> dict[str, Any]:
        print("latency:", flush=True)
        return suites.latency(seconds=5.0 if args.quick else 10.0)

    def shards_suite() -> dict[str, Any]:
        print(f"whole host on a {shards_bench.SHARDS}-shard Redis Cluster vs one Redis:",
              flush=True)
        return shards_bench.run(10.0 if args.quick else 20.0, repeat)

    def async_suite() -> dict[str, Any]:
        print("async handlers, 10 ms await per job, one process:", flush=True)
        return alternate(async_bench.systems(peer_jobs, peers), repeat)

    def fleet_suite() -> dict[str, Any]:
        print("live fleet: one manager, real masters and slots, many queues:", flush=True)
        return fleet.run("10x150,40x150" if args.quick else "10x30,10x150,40x30,40x150",
                         20.0 if args.quick else 60.0)

    return {"consume": consume_suite, "enqueue": enqueue_suite, "host": host_suite,
            "planner": planner_bench.run, "simulator": sim_bench.run,
            "simreal": sim_vs_real.run, "memory": memory_suite,
            "latency": latency_suite, "async": async_suite, "shards": shards_suite,
            "fleet": fleet_suite,
            "retention": lambda: retention_bench.run(5_000 if args.quick else 20_000, repeat)}


def rerender() -> None:
    """The targets and latest.md again from latest.json (after a change of targets)."""
    saved = json.loads((RESULTS / "latest.json").read_text())
    saved["targets"] = targets(saved)
    (RESULTS / "latest.json").write_text(json.dumps(saved, indent=2))
    (RESULTS / "latest.md").write_text(markdown(saved))


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))

