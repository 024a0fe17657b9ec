"""Enqueue throughput, memory per worker, and enqueue-to-start latency."""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

from kombu import Connection, Exchange, Producer, Queue

from bench.common import BROKERS, REDIS, free_listen, python, spawn, stop, unique
from qcluster.client import Client
from qcluster.procfs import read_memory


def enqueue_one_by_one(backend: str, jobs: int) -> float:
    queue = unique("enq1")
    with Client(BROKERS[backend]) as client:
        start = time.perf_counter()
        for n in range(jobs):
            client.enqueue(queue, {"n": n})
        rate = jobs / (time.perf_counter() - start)
        client.purge(queue)
    return rate


def enqueue_many(backend: str, jobs: int) -> float:
    queue = unique("enqN")
    with Client(BROKERS[backend]) as client:
        start = time.perf_counter()
        for first in range(0, jobs, 1000):
            client.enqueue_many(queue, [{"n": n} for n in range(first, first + 1000)])
        rate = jobs / (time.perf_counter() - start)
        client.purge(queue)
    return rate


def kombu_publish(url: str, jobs: int) -> float:
    name = unique("kpub")
    with Connection(url) as connection:
        queue = Queue(name, Exchange(name, type="direct"), routing_key=name, durable=True)
        channel = connection.channel()
        queue(channel).declare()
        producer = Producer(channel, exchange=queue.exchange, routing_key=name, serializer="json")
        start = time.perf_counter()
        for n in range(jobs):
            producer.publish({"n": n})
        rate = jobs / (time.perf_counter() - start)
        queue(connection.channel()).delete()
    return rate


def enqueue_systems(jobs: int) -> dict[str, Any]:
    return {
        "Client.enqueue redis": lambda: enqueue_one_by_one("redis", jobs),
        "Client.enqueue_many redis": lambda: enqueue_many("redis", jobs * 5),
        "Client.enqueue rabbitmq (confirmed)": lambda: enqueue_one_by_one("rabbitmq", jobs // 4),
        "Client.enqueue_many rabbitmq (confirmed)": lambda: enqueue_many("rabbitmq", jobs),
        # 2,000 as for the peers: at ~2,000/s a bigger count only makes the run longer.
        "kombu publish redis (no batching)": lambda: kombu_publish(REDIS, min(jobs, 2_000)),
        "kombu publish rabbitmq (no confirms)": lambda: kombu_publish(BROKERS["rabbitmq"], jobs),
    }


def memory_of_slots(slots: int = 8, ballast_mb: int = 100) -> dict[str, Any]:
    """PSS and USS of a master with ``slots`` slots of an app allocating ``ballast_mb``."""
    queue = unique("mem")
    proc = spawn([python(), "-m", "qcluster", "master", "--app", "bench.apps", "--broker", REDIS,
                  "--slots", f"{queue}={slots}", "--listen", free_listen(), "--no-metrics",
                  "--log-level", "WARNING"], QB_QUEUE=queue, QB_BALLAST_MB=str(ballast_mb))
    try:
        tree = process_tree_memory(proc.pid, slots)
    finally:
        stop(proc)
    single = single_process_pss(python(), "bench.apps", ballast_mb)
    return {**tree, "ballast_mb": ballast_mb, "one_process_pss_mib": round(single / MIB, 1),
            "total_over_one_process": round(tree["total_pss_mib"] * MIB / single, 2),
            "target": "total PSS of 8 slots under 2x one process"}


MIB = 1 << 20


def process_tree_memory(root: int, workers: int) -> dict[str, Any]:
    """PSS/USS of a worker system's whole process tree, once ``workers`` processes run under
    ``root`` and have had time to import the app."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(_descendants(root)) < workers:
        time.sleep(0.5)
    time.sleep(3)
    root_memory = read_memory(root)
    samples = [m for m in (read_memory(pid) for pid in _descendants(root)) if m]
    total = sum(s.pss_bytes for s in samples) + (root_memory.pss_bytes if root_memory else 0)
    return {
        "workers": len(samples),
        "worker_pss_mib": [round(s.pss_bytes / MIB, 1) for s in samples],
        "worker_uss_mib": [round(s.uss_bytes / MIB, 1) for s in samples],
        "parent_pss_mib": round(root_memory.pss_bytes / MIB, 1) if root_memory else None,
        "total_pss_mib": round(total / MIB, 1),
    }


def _descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def single_process_pss(interpreter: str, module: str, ballast_mb: int) -> int:
    """PSS of one process that imports ``module`` (what a per-process worker pays)."""
    import subprocess

    from bench.common import env

    code = (f"import {module}, re\n"
            "text = open('/proc/self/smaps_rollup').read()\n"
            "print(int(re.search(r'^Pss:\\s+(\\d+)', text, re.M).group(1)) * 1024)")
    out = subprocess.run([interpreter, "-c", code], env=env(QB_BALLAST_MB=str(ballast_mb)),
                         capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def latency(rate: float = 500.0, seconds: float = 10.0) -> dict[str, Any]:
    """Enqueue-to-start at a steady rate with idle slots (2 slots, batch 1, Redis)."""
    queue = unique("lat")
    log = f"/tmp/qcluster-bench-latency-{os.getpid()}.jsonl"
    proc = spawn([python(), "-m", "qcluster", "master", "--app", "bench.latency_app",
                  "--broker", REDIS, "--slots", f"{queue}=2", "--listen", free_listen(),
                  "--log-level", "WARNING"], QB_QUEUE=queue, QB_LATENCY_LOG=log)
    try:
        time.sleep(4)
        with Client(REDIS) as client:
            interval, sent = 1.0 / rate, 0
            start = time.perf_counter()
            while time.perf_counter() - start < seconds:
                client.enqueue(queue, {"t": time.time()})
                sent += 1
                pause = start + sent * interval - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
        time.sleep(2)
    finally:
        stop(proc)
    with open(log) as handle:
        waits = sorted(json.loads(line) for line in handle)
    os.unlink(log)
    ms = [w * 1000 for w in waits]
    return {"rate": rate, "jobs": len(ms), "p50_ms": statistics.median(ms),
            "p99_ms": ms[int(0.99 * (len(ms) - 1))], "target_p99_ms": 50.0}
