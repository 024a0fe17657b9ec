"""Whole host: `qcluster master` with 2 slots draining no-op jobs (batch 100) on the
embedded broker (and Redis), metrics on vs off; and the cost of probing 100 slots' memory.

``python -m bench.master_bench [--seconds S]`` prints JSON and writes
bench/results/master.json.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from typing import Any

from bench.common import BROKERS, ROOT, python, spawn, stop, unique
from qcluster.client import Client
from qcluster.procfs import read_memory


def sustained(backend: str, metrics_on: bool, seconds: float) -> float:
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
            return done / (time.perf_counter() - start)
        finally:
            stop_feeding.set()
            stop(proc)
            feeder.join()
            client.purge(queue)


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


def run(seconds: float = 20.0) -> dict[str, Any]:
    results: dict[str, Any] = {"seconds": seconds}
    for backend in ("embedded", "redis"):
        on, off = [], []
        for _ in range(2):  # alternate on/off
            on.append(sustained(backend, True, seconds))
            off.append(sustained(backend, False, seconds))
        results[backend] = {"metrics_on": on, "metrics_off": off,
                            "overhead": 1 - (sum(on) / sum(off))}
    results["probe_100_slots_ms"] = probe_cost()
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    (ROOT / "bench" / "results" / "master.json").write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=20.0)
    print(json.dumps(run(parser.parse_args().seconds), indent=2))
