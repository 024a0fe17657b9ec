"""Whole host: `qcluster master` with 2 slots draining no-op jobs (batch 100) on the
embedded broker (and Redis), metrics on vs off, with a producer keeping the queue full and
(Redis) with every job queued beforehand; and the cost of probing 100 slots' memory.

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

from bench.common import (
    BROKERS,
    ROOT,
    enqueue_noops,
    env,
    free_listen,
    python,
    spawn,
    stop,
    unique,
)
from qcluster.client import Client
from qcluster.procfs import read_memory

#: Jobs queued before a host run starts, and the depth the producer keeps it above: a
#: queue that ran dry would measure the producer, not the host.
HOST_BUFFER = 300_000
#: Seconds from the master's start to the measurement: its slots forked and warm.
WARM_UP_S = 3.0


#: The fastest a 2-core host is expected to drain no-op jobs: a producer-free run queues
#: this many jobs per second of its window (and of its warm-up) before the master starts.
HOST_CEILING_PER_S = 120_000


def sustained(backend: str, metrics_on: bool, seconds: float, *,
              producer: bool = True) -> dict[str, Any]:
    """Jobs/s over ``seconds`` while a producer keeps the queue full, or (``producer``
    False) with every job queued before the master starts, so that the two cores go to
    the master, its slots and the broker alone; the lowest depth seen (0 would mean the
    queue ran dry: the measurement's limit, not the host's) and each process's share of
    a core."""
    url, queue = BROKERS[backend], unique("host")
    flag = "--metrics" if metrics_on else "--no-metrics"
    stop_feeding = threading.Event()
    queued = HOST_BUFFER if producer else int(HOST_CEILING_PER_S * (seconds + WARM_UP_S))
    published = [queued]

    def feed() -> None:
        with Client(url) as producer:
            while not stop_feeding.is_set():
                if producer.stats(queue)["ready"] < HOST_BUFFER:
                    enqueue_noops(producer, queue, 20_000)
                    published[0] += 20_000
                else:
                    time.sleep(0.05)

    with Client(url) as client:
        enqueue_noops(client, queue, queued)
        feeder = threading.Thread(target=feed, daemon=True)
        if producer:
            feeder.start()
        proc = spawn([python(), "-m", "qcluster", "master", "--app", "bench.apps",
                      "--broker", url, "--slots", f"{queue}=2", "--listen", free_listen(),
                      flag, "--log-level", "WARNING"],
                     QB_QUEUE=queue, QB_BATCH="100",
                     QCLUSTER_METRICS_DIR=f"/dev/shm/qcluster-bench-{os.getpid()}")
        try:
            time.sleep(WARM_UP_S)  # slots forked and warm
            return _watch_host(client, queue, published, proc.pid, _broker_pid(client), seconds)
        finally:
            stop_feeding.set()
            stop(proc)
            if producer:
                feeder.join()
            _drop(client, queue)


def _drop(client: Client, queue: str) -> None:
    """Delete the queue's keys without blocking the server: a purge script (or a DEL) of
    a million jobs can outlast the client's socket timeout on a busy machine."""
    redis_client = client.broker.redis_client()
    assert redis_client is not None, "the host suite runs on Redis-based brokers only"
    redis_client.unlink(*redis_client.keys(f"*{{{queue}}}*"))  # the queue's own keys


def _watch_host(client: Client, queue: str, published: list[int], master_pid: int,
                broker_pid: int | None, seconds: float) -> dict[str, Any]:
    def consumed() -> tuple[int, int]:
        stats = client.stats(queue)
        return published[0] - stats["ready"] - stats["locked"], stats["ready"]

    master = psutil.Process(master_pid)
    roles = {"master": [master], "slots": master.children(),
             "producer and observer (this process)": [psutil.Process()]}
    if broker_pid:
        roles["broker (redis-server)"] = [psutil.Process(broker_pid)]
    cpu_before = {role: _cpu_seconds(procs) for role, procs in roles.items()}
    done_before, lowest = consumed()
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        time.sleep(1.0)
        lowest = min(lowest, consumed()[1])
    elapsed = time.perf_counter() - start
    done = consumed()[0] - done_before
    return {
        "jobs_per_s": done / elapsed,
        "lowest_ready": lowest,
        "cpu_share": {role: round((_cpu_seconds(procs) - cpu_before[role]) / elapsed, 2)
                      for role, procs in roles.items()},
    }


def _broker_pid(client: Client) -> int | None:
    """The Redis server's pid when it runs on this machine (the embedded one always does)."""
    redis_client = client.broker.redis_client()
    if redis_client is None:
        return None
    pid = int(redis_client.info("server")["process_id"])
    return pid if psutil.pid_exists(pid) else None


def _cpu_seconds(processes: list[psutil.Process]) -> float:
    """CPU seconds used so far by all their threads, in nanoseconds' precision where /proc
    has schedstat (psutil's cpu_times counts 10 ms ticks: 1% of a 1 s measurement)."""
    total = 0.0
    for process in processes:
        try:
            tasks = list(os.scandir(f"/proc/{process.pid}/task"))
        except OSError:
            times = process.cpu_times()
            total += times.user + times.system
            continue
        for task in tasks:
            try:
                with open(f"{task.path}/schedstat") as stat:
                    total += int(stat.read().split()[0]) / 1e9
            except FileNotFoundError:  # a thread that ended: its time is gone with it
                pass
    return total


def slot_cpu_pair(backend: str, jobs: int = 100_000, *, on_first: bool = True
                  ) -> dict[str, float]:
    """Microseconds of slot CPU per job, metrics on and off, measured side by side.

    Two slots (batch 100) drain ``jobs`` each from their own queue at the same time, so
    both see the same machine: on this shared 2-core host a CPU-bound loop varies by
    10-20% from one minute to the next, more than the 5% being measured. Each slot's CPU
    (nanoseconds, /proc/PID/schedstat) is read at its first job gone and at its queue
    empty: start-up is not counted.
    """
    url = BROKERS[backend]
    queues = {"on": unique("cpu-on"), "off": unique("cpu-off")}
    metrics_dir = f"/dev/shm/qcluster-bench-cpu-{os.getpid()}"
    os.makedirs(metrics_dir, exist_ok=True)
    with Client(url) as client:
        for queue in queues.values():
            enqueue_noops(client, queue, jobs)
        procs = {}
        for variant in (("on", "off") if on_first else ("off", "on")):
            extra = {"PROMETHEUS_MULTIPROC_DIR": metrics_dir} if variant == "on" else {}
            procs[variant] = spawn(
                [python(), "-m", "qcluster", "slot", "--app", "bench.apps", "--queue",
                 queues[variant], "--broker", url, "--burst", "--log-level", "WARNING"],
                QB_QUEUE=queues[variant], QB_BATCH="100", **extra)
        try:
            return _cpu_per_job_until_empty(client, queues, procs, jobs)
        finally:
            for proc in procs.values():
                stop(proc)
            for queue in queues.values():
                client.purge(queue)


def _cpu_per_job_until_empty(client: Client, queues: dict[str, str],
                             procs: dict[str, subprocess.Popen[bytes]], jobs: int
                             ) -> dict[str, float]:
    slots = {variant: psutil.Process(proc.pid) for variant, proc in procs.items()}
    cores = os.sched_getaffinity(0)
    if len(cores) > 1:  # both slots share one core; the broker and this process the rest
        for slot in slots.values():
            slot.cpu_affinity([max(cores)])
    started: dict[str, tuple[float, int]] = {}
    result: dict[str, float] = {}
    while len(result) < len(queues):
        for variant, queue in queues.items():
            if variant in result:
                continue
            ready = client.stats(queue)["ready"]
            if variant not in started:
                if ready < jobs:
                    started[variant] = (_cpu_seconds([slots[variant]]), ready)
            elif ready == 0:
                cpu_start, left = started[variant]
                result[variant] = (_cpu_seconds([slots[variant]]) - cpu_start) / left * 1e6
        time.sleep(0.005)
    return result


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


def run(seconds: float = 60.0, rounds: int = 5) -> dict[str, Any]:
    """Metrics on for ``seconds`` and off for a quarter as long, on each broker; and one slot's
    CPU per job with metrics on and off, side by side, ``rounds`` times."""
    results: dict[str, Any] = {"seconds_on": seconds, "seconds_off": seconds / 4,
                               "metrics_cost_us_per_job": metrics_cost()}
    # Redis drains faster than one producer thread fills it (the queue ran dry at ~48,000
    # jobs/s): the host's own rate is measured with every job queued beforehand.
    results["redis_no_producer"] = sustained("redis", True, min(seconds, 15.0), producer=False)
    for backend in ("embedded", "redis"):
        on = sustained(backend, True, seconds)
        off = sustained(backend, False, seconds / 4)
        cpu: dict[str, list[float]] = {"on": [], "off": []}
        for round_no in range(rounds):
            pair = slot_cpu_pair(backend, on_first=round_no % 2 == 0)
            cpu["on"].append(pair["on"])
            cpu["off"].append(pair["off"])
        results[backend] = {
            "metrics_on": on, "metrics_off": off,
            "rate_overhead": 1 - on["jobs_per_s"] / off["jobs_per_s"],
            "slot_cpu_us_per_job": cpu,
            "cpu_overhead": statistics.median(
                a / b - 1 for a, b in zip(cpu["on"], cpu["off"], strict=True)),
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
