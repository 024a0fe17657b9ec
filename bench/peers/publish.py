"""``python -m bench.peers.publish SYSTEM N TIMED``: publish N no-op jobs for a peer.

The first TIMED jobs go one call per job, the way a web handler publishes, and are timed
(the enqueue suite's figure). The rest go the fastest way the peer offers (RQ's
``enqueue_many`` pipeline, concurrent arq calls, copies of a message Celery published itself
on Redis, Dramatiq's own sends with their Redis scripts pipelined): they only fill the queue
for the consume suite. Prints JSON with both counts and times.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis

QUEUE = os.environ.get("QB_QUEUE", "bench")
URL = os.environ.get("QB_BROKER", "redis://127.0.0.1:6379/9")
#: (publish one at a time, publish in bulk), each taking a range of job numbers
Publisher = tuple[Callable[[range], None], Callable[[range], None]]


def celery() -> Publisher:
    from bench.peers.celery_app import noop

    def one_by_one(numbers: range) -> None:
        for n in numbers:
            noop.delay(n)

    def bulk(numbers: range) -> None:
        # Celery has no bulk publish and spends ~1 ms of CPU on each message: 20,000 took
        # 8 s. Celery publishes the first message itself; the rest are copies of it with
        # fresh ids (the worker sees Celery's own messages).
        if not numbers:
            return
        if not URL.startswith("redis"):
            _celery_copies_by_kombu(noop, numbers)
            return
        noop.delay(numbers.start)
        client = redis.Redis.from_url(URL)
        template = json.loads(client.lindex(QUEUE, 0) or b"{}")
        pipe = client.pipeline(transaction=False)
        for count, _ in enumerate(numbers[1:], 1):
            pipe.lpush(QUEUE, json.dumps(_with_new_ids(template)))
            if count % 1000 == 0:
                pipe.execute()
        pipe.execute()

    return one_by_one, bulk


def _celery_copies_by_kombu(task: Any, numbers: range) -> None:
    """Publish one message through Celery, then copies of it through the same kombu
    producer with the arguments Celery gave it (new ids)."""
    from kombu.messaging import Producer

    original = Producer.publish
    captured: dict[str, Any] = {}

    def capture(self: Producer, body: Any, **kwargs: Any) -> Any:
        captured.update(body=body, kwargs=kwargs)
        return original(self, body, **kwargs)

    Producer.publish = capture  # type: ignore[method-assign, assignment]
    try:
        with task.app.producer_or_acquire() as producer:
            task.apply_async((numbers.start,), producer=producer)
            Producer.publish = original  # type: ignore[method-assign]
            for _ in numbers[1:]:
                task_id, headers = _new_task_id(captured["kwargs"]["headers"])
                producer.publish(captured["body"], **{
                    **captured["kwargs"], "headers": headers, "correlation_id": task_id})
    finally:
        Producer.publish = original  # type: ignore[method-assign]


def _new_task_id(headers: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A fresh task id and a copy of a Celery message's headers carrying it."""
    task_id = str(uuid.uuid4())
    return task_id, {**headers, "id": task_id, "root_id": task_id}


def _with_new_ids(message: dict[str, Any]) -> dict[str, Any]:
    """A copy of a Celery message (kombu's Redis envelope) with a new task id and tag."""
    task_id, headers = _new_task_id(message["headers"])
    properties = {**message["properties"], "correlation_id": task_id,
                  "delivery_tag": str(uuid.uuid4())}
    return {**message, "headers": headers, "properties": properties}


def dramatiq() -> Publisher:
    from bench.peers.dramatiq_app import noop

    def one_by_one(numbers: range) -> None:
        for n in numbers:
            noop.send(n)

    def bulk(numbers: range) -> None:
        broker = noop.broker
        scripts = getattr(broker, "scripts", None)
        if scripts is None:  # RabbitMQ: publishing is cheap enough one by one
            one_by_one(numbers)
            return
        # Dramatiq builds every message itself; only its enqueue script calls are
        # pipelined, a thousand per round trip.
        dispatch = scripts["dispatch"]
        pipe = broker.client.pipeline(transaction=False)
        scripts["dispatch"] = lambda keys, args: dispatch(keys=keys, args=args, client=pipe)
        try:
            for count, n in enumerate(numbers, 1):
                noop.send(n)
                if count % 1000 == 0:
                    pipe.execute()
            pipe.execute()
        finally:
            scripts["dispatch"] = dispatch

    return one_by_one, bulk


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
