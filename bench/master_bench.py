"""Whole host: `qcluster master` with 2 slots draining no-op jobs (batch 100) on the
embedded broker (and Redis), metrics on vs off; and the cost of probing 100 slots' memory.

``python -m bench.master_bench [--seconds S]`` prints JSON and writes
bench/results/master.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import threading
import time
from typing import Any

import psutil

from bench.common import BROKERS, ROOT, env, python, spawn, stop, unique
from qcluster.client import Client
from qcluster.procfs import read_memory


def sustained(backend: str, metrics_on: bool, seconds: float) -> dict[str, float]:
    """Jobs/s over ``seconds`` while a producer keeps the queue full."""
    url, queue = BROKERS[backend], unique("host")
    flag = "--metrics" if metrics_on else "--no-metrics"
    stop_feeding = threading.Event()
    published = [100_000]

    def feed() -> None:
        with Client(url) as producer:
            while not stop_feeding.is_set():
                if producer.stats(queue)["ready"] < 200_000:
                    producer.enqueue_many(queue, [{}] * 20_000)
                    published[0] += 20_000
                else:
                    time.sleep(0.05)

    def consumed() -> int:
        stats = client.stats(queue)
        return published[0] - stats["ready"] - stats["locked"]

    with Client(url) as client:
        client.enqueue_many(queue, [{}] * 100_000)
        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        proc = spawn([python(), "-m", "qcluster", "master", "--app", "bench.apps",
                      "--broker", url, "--slots", f"{queue}=2", "--listen", "127.0.0.1:0",
                      flag, "--log-level", "WARNING"],
                     QB_QUEUE=queue, QB_BATCH="100",
                     QCLUSTER_METRICS_DIR=f"/dev/shm/qcluster-bench-{os.getpid()}")
        try:
            time.sleep(3)  # slots forked and warm
            done_before = consumed()
            start = time.perf_counter()
            time.sleep(seconds)
            done = consumed() - done_before
            return {"jobs_per_s": done / (time.perf_counter() - start)}
        finally:
            stop_feeding.set()
            stop(proc)
            feeder.join()
            client.purge(queue)


def _cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        times = process.cpu_times()
        total += times.user + times.system
    return total


def slot_cpu_per_job(backend: str, metrics_on: bool, jobs: int = 200_000) -> float:
    """Microseconds of one slot's CPU per job while it drains ``jobs`` (batch 100), read
    from /proc at the first job gone and at the last: start-up is not counted, and a
    single process on a 2-core machine is far less noisy than a saturated host."""
    url, queue = BROKERS[backend], unique("cpu")
    extra = {"PROMETHEUS_MULTIPROC_DIR": f"/dev/shm/qcluster-bench-cpu-{os.getpid()}"}
    os.makedirs(extra["PROMETHEUS_MULTIPROC_DIR"], exist_ok=True)
    with Client(url) as client:
        for first in range(0, jobs, 20_000):
            client.enqueue_many(queue, [{}] * min(20_000, jobs - first))
        proc = spawn([python(), "-m", "qcluster", "slot", "--app", "bench.apps", "--queue",
                      queue, "--broker", url, "--burst", "--log-level", "WARNING"],
                     QB_QUEUE=queue, QB_BATCH="100", **(extra if metrics_on else {}))
        try:
            slot = psutil.Process(proc.pid)
            while (left := client.stats(queue)["ready"]) == jobs:
                time.sleep(0.002)
            cpu_start = _cpu_seconds([slot])
            while client.stats(queue)["ready"] > 0:
                time.sleep(0.002)
            return (_cpu_seconds([slot]) - cpu_start) / left * 1e6
        finally:
            stop(proc)
            client.purge(queue)


def metrics_cost() -> float:
    """Microseconds of recording one job's metrics (``bench.metrics_cost``)."""
    out = subprocess.run([python(), "-m", "bench.metrics_cost"], cwd=ROOT, env=env(),
                         capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def probe_cost(slots: int = 100) -> float:
    """Milliseconds to read smaps_rollup of ``slots`` processes."""
    pids = []
    for _ in range(slots):
        pid = os.fork()
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        pids.append(pid)
    try:
        start = time.perf_counter()
        for pid in pids:
            read_memory(pid)
        return (time.perf_counter() - start) * 1000
    finally:
        for pid in pids:
            os.kill(pid, 9)
            os.waitpid(pid, 0)


def run(seconds: float = 60.0, rounds: int = 3) -> dict[str, Any]:
    """Metrics on for ``seconds`` and off for a third as long, on each broker; and one slot's
    CPU per job with metrics on and off, alternating ``rounds`` times."""
    results: dict[str, Any] = {"seconds_on": seconds, "seconds_off": seconds / 3,
                               "metrics_cost_us_per_job": metrics_cost()}
    for backend in ("embedded", "redis"):
        on = sustained(backend, True, seconds)
        off = sustained(backend, False, seconds / 3)
        cpu: dict[str, list[float]] = {"on": [], "off": []}
        for _ in range(rounds):
            cpu["on"].append(slot_cpu_per_job(backend, True))
            cpu["off"].append(slot_cpu_per_job(backend, False))
        results[backend] = {
            "metrics_on": on, "metrics_off": off,
            "rate_overhead": 1 - on["jobs_per_s"] / off["jobs_per_s"],
            "slot_cpu_us_per_job": cpu,
            "cpu_overhead": statistics.median(cpu["on"]) / statistics.median(cpu["off"]) - 1,
            "recording_overhead": results["metrics_cost_us_per_job"] / statistics.median(
                cpu["off"]),
        }
    results["probe_100_slots_ms"] = probe_cost()
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    (ROOT / "bench" / "results" / "master.json").write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60.0)
    print(json.dumps(run(parser.parse_args().seconds), indent=2))
