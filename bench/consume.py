"""Consume throughput of one process: qcluster slots vs plain kombu consumers, and the raw
Redis round-trip rate (the physical limit of one-job-per-round-trip designs)."""

from __future__ import annotations

import time
from typing import Any

import redis
from amqp.exceptions import ChannelError
from kombu import Connection, Exchange, Producer, Queue

from bench.common import BROKERS, REDIS, WINDOW_S, python, spawn, stop, unique
from bench.common import drain_rate as observe
from qcluster.client import Client

#: The quorum-queue variant: every queue this bench declares is a RabbitMQ quorum queue.
_JOIN = "&" if "?" in BROKERS["rabbitmq"] else "?"
RABBITMQ_QUORUM = f"{BROKERS['rabbitmq']}{_JOIN}queue_type=quorum"


def qcluster_slot(backend: str, batch: int, jobs: int, url: str | None = None) -> float:
    url, queue = url or BROKERS[backend], unique(f"slot{batch}")
    with Client(url) as client:
        for start in range(0, jobs, 10_000):
            client.enqueue_many(queue, [{"n": n} for n in range(start, min(jobs, start + 10_000))])
        proc = spawn([python(), "-m", "qcluster", "slot", "--app", "bench.apps", "--queue", queue,
                      "--broker", url, "--burst", "--log-level", "WARNING"],
                     QB_QUEUE=queue, QB_BATCH=str(batch))
        try:
            return observe(jobs, lambda: client.stats(queue)["ready"])
        finally:
            stop(proc)
            client.purge(queue)


def kombu_consumer(url: str, jobs: int, ack_every: int, window_s: float | None = None) -> float:
    queue_name = unique("kombu")
    with Connection(url) as connection:
        queue = Queue(queue_name, Exchange(queue_name, type="direct"), routing_key=queue_name,
                      durable=True)
        producer = Producer(connection.channel(), exchange=queue.exchange,
                            routing_key=queue_name, serializer="json")
        queue(producer.channel).declare()
        for n in range(jobs):
            producer.publish({"n": n})

        def ready() -> int:
            try:
                return int(queue(connection.channel()).queue_declare(passive=True).message_count)
            except ChannelError:  # kombu's Redis transport drops an emptied queue's binding
                return 0

        proc = spawn([python(), "-m", "bench.kombu_consumer", url, queue_name, "100",
                      str(ack_every)])
        try:
            return observe(jobs, ready, window_s=window_s)
        finally:
            stop(proc)
            queue(connection.channel()).delete()


def redis_round_trips(seconds: float = 2.0) -> float:
    client = redis.Redis.from_url(REDIS)
    done, end = 0, time.perf_counter() + seconds
    start = time.perf_counter()
    while time.perf_counter() < end:
        client.ping()
        done += 1
    client.close()
    return done / (time.perf_counter() - start)


def systems(jobs: int, rabbitmq_jobs: int) -> dict[str, Any]:
    """name -> zero-argument function returning jobs/s (one run).

    On RabbitMQ every consumer starts from the same depth as the peers (``rabbitmq_jobs``):
    a deeper classic queue costs the broker more per message (50,000 deep drains about a
    third slower than 20,000 here), which would blur the comparison.
    """
    runs: dict[str, Any] = {}
    for backend in ("redis", "rabbitmq", "embedded"):
        depth = rabbitmq_jobs if backend == "rabbitmq" else jobs
        for batch in (1, 10, 100):
            runs[f"qcluster slot {backend} batch {batch}"] = (
                lambda b=backend, n=batch, d=depth: qcluster_slot(b, n, d))
    for batch in (10, 100):  # classic vs quorum: the same slot, the same depth
        runs[f"qcluster slot rabbitmq quorum batch {batch}"] = (
            lambda n=batch: qcluster_slot("rabbitmq", n, rabbitmq_jobs, RABBITMQ_QUORUM))
    # 1,500 jobs/s: 6,000 fill it for longer than its 3-second window.
    runs["kombu consumer redis, prefetch 100, ack each"] = (
        lambda: kombu_consumer(REDIS, min(jobs, 6_000), 1, window_s=WINDOW_S))
    runs["kombu consumer rabbitmq, prefetch 100, ack each"] = (
        lambda: kombu_consumer(BROKERS["rabbitmq"], rabbitmq_jobs, 1))
    runs["kombu consumer rabbitmq, prefetch 100, multiple-ack per 100"] = (
        lambda: kombu_consumer(BROKERS["rabbitmq"], rabbitmq_jobs, 100))
    runs["raw redis round trips (PING/s)"] = redis_round_trips
    return runs


def commands() -> dict[str, str]:
    """The exact command behind each qcluster and kombu row (queue shown as QUEUE)."""
    return {
        "qcluster slot BROKER batch N": "QB_BATCH=N python -m qcluster slot --app bench.apps "
                                        "--queue QUEUE --broker URL --burst --log-level WARNING",
        "kombu consumer ...": "python -m bench.kombu_consumer URL QUEUE 100 ACK_EVERY",
        "qcluster master (host, memory)": "python -m qcluster master --app bench.apps --broker URL"
                                          " --slots QUEUE=N --listen 127.0.0.1:PORT [--no-metrics]",
    }
