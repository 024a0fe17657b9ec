"""Async handlers: one process awaiting a 10 ms I/O per job, qcluster's async slot (batch
100, concurrency 100) beside arq (max_jobs 100) on the same Redis, from the same depth.

Both are timed from outside by the same observer (bench.common.drain_rate): from the first
job gone until the queue is empty. The ceiling of one process is concurrency / 10 ms =
10,000 jobs/s; what each system loses below it is its own cost per job.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.common import BROKERS, kill, python, spawn, stop, unique
from bench.common import drain_rate as observe
from bench.peer_runs import PEER_REDIS, clean, fill, peer_bin, redis_count
from qcluster.client import Client

IO_S = 0.01
BATCH = CONCURRENCY = 100
QCLUSTER_ROW = "qcluster async slot, batch 100, concurrency 100, redis"
ARQ_ROW = "arq max_jobs 100, poll 10 ms, no results, redis"
#: arq is watched this long, not until its queue is empty (a few hundred jobs/s on a loaded
#: 2-core machine: 20,000 jobs took a minute a run); its rate is steady within seconds.
ARQ_WINDOW_S = 10.0


def qcluster_async_slot(backend: str, jobs: int) -> float:
    url, queue = BROKERS[backend], unique("async")
    with Client(url) as client:
        for start in range(0, jobs, 10_000):
            client.enqueue_many(queue, [{"n": n} for n in range(start, min(jobs, start + 10_000))])
        proc = spawn(qcluster_command(queue, url), QB_QUEUE=queue, QB_BATCH=str(BATCH),
                     QB_CONCURRENCY=str(CONCURRENCY), QB_IO_S=str(IO_S))
        try:
            return observe(jobs, lambda: client.stats(queue)["ready"], timeout_s=120)
        finally:
            stop(proc)
            client.purge(queue)


def qcluster_command(queue: str, url: str) -> list[str]:
    return [python(), "-m", "qcluster", "slot", "--app", "bench.async_apps", "--queue", queue,
            "--broker", url, "--burst", "--log-level", "WARNING"]


def arq_async(jobs: int) -> float:
    queue = unique("arq-async")
    remaining = redis_count("ZCARD", str)(queue)
    try:
        fill("arq", "redis", queue, jobs)
        proc = spawn(arq_command(), QB_QUEUE=queue, QB_BROKER=PEER_REDIS,
                     QB_CONCURRENCY=str(CONCURRENCY), QB_IO_S=str(IO_S))
        try:
            return observe(jobs, remaining, timeout_s=120, window_s=ARQ_WINDOW_S)
        finally:
            kill(proc)
    finally:
        clean("redis", queue)


def arq_command() -> list[str]:
    return [peer_bin("arq", "arq"), "bench.peers.arq_async_app.WorkerSettings",
            "--custom-log-dict", "bench.peers.arq_app.QUIET_LOGS"]


def systems(jobs: int, peers: bool) -> dict[str, Callable[[], float]]:
    """name -> one run returning jobs/s; arq only with the peers."""
    runs: dict[str, Callable[[], float]] = {QCLUSTER_ROW: lambda: qcluster_async_slot(
        "redis", jobs)}
    if peers:
        runs[ARQ_ROW] = lambda: arq_async(jobs)
    return runs


def commands() -> dict[str, Any]:
    """The exact commands of both rows (queue shown as QUEUE)."""
    from bench.common import ROOT

    return {
        QCLUSTER_ROW: "QB_BATCH=100 QB_CONCURRENCY=100 " + " ".join(
            qcluster_command("QUEUE", "URL")).replace(python(), "python"),
        ARQ_ROW: "QB_CONCURRENCY=100 " + " ".join(arq_command()).replace(
            str(ROOT) + "/", ""),
    }
