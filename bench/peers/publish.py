"""``python -m bench.peers.publish SYSTEM N TIMED``: publish N no-op jobs for a peer.

The first TIMED jobs go one call per job, the way a web handler publishes, and are timed
(the enqueue suite's figure). The rest go the fastest way the peer offers (RQ's
``enqueue_many`` pipeline, concurrent arq calls; Celery and Dramatiq have no bulk publish):
they only fill the queue for the consume suite. Prints JSON with both counts and times.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Callable

QUEUE = os.environ.get("QB_QUEUE", "bench")
URL = os.environ.get("QB_BROKER", "redis://127.0.0.1:6379/9")
#: (publish one at a time, publish in bulk), each taking a range of job numbers
Publisher = tuple[Callable[[range], None], Callable[[range], None]]


def celery() -> Publisher:
    from bench.peers.celery_app import noop

    def one_by_one(numbers: range) -> None:
        for n in numbers:
            noop.delay(n)

    return one_by_one, one_by_one


def dramatiq() -> Publisher:
    from bench.peers.dramatiq_app import noop

    def one_by_one(numbers: range) -> None:
        for n in numbers:
            noop.send(n)

    return one_by_one, one_by_one


def rq() -> Publisher:
    from redis import Redis
    from rq import Queue

    from bench.peers.rq_jobs import noop

    queue = Queue(QUEUE, connection=Redis.from_url(URL))

    def one_by_one(numbers: range) -> None:
        for n in numbers:
            queue.enqueue(noop, n, result_ttl=0)

    def bulk(numbers: range) -> None:
        for first in range(numbers.start, numbers.stop, 1000):
            queue.enqueue_many([Queue.prepare_data(noop, (n,), result_ttl=0)
                                for n in range(first, min(first + 1000, numbers.stop))])

    return one_by_one, bulk


def arq() -> Publisher:
    from arq import create_pool
    from arq.connections import RedisSettings

    async def publish(numbers: range, concurrent: int) -> None:
        pool = await create_pool(RedisSettings.from_dsn(URL))
        for first in range(numbers.start, numbers.stop, concurrent):
            await asyncio.gather(*(pool.enqueue_job("noop", n, _queue_name=QUEUE) for n in
                                   range(first, min(first + concurrent, numbers.stop))))
        await pool.aclose()

    return (lambda numbers: asyncio.run(publish(numbers, 1)),
            lambda numbers: asyncio.run(publish(numbers, 500)))


SYSTEMS: dict[str, Callable[[], Publisher]] = {
    "celery": celery, "dramatiq": dramatiq, "rq": rq, "arq": arq}


def main() -> None:
    system, jobs, timed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    one_by_one, bulk = SYSTEMS[system]()
    start = time.perf_counter()
    one_by_one(range(timed))
    timed_seconds = time.perf_counter() - start
    bulk(range(timed, jobs))
    print(json.dumps({"timed_jobs": timed, "timed_seconds": timed_seconds, "jobs": jobs,
                      "seconds": time.perf_counter() - start}))


if __name__ == "__main__":
    main()
