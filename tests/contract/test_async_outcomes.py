"""Async handlers in a real slot loop, on every backend (issue 19 item 3): the slot outcome
suite's cases with ``async def`` handlers, per-job concurrency, and the batch deadline.

The slot runs in a thread of its own: it makes its event loop there, as a slot process does
(a test elsewhere in the suite may leave a loop running in the main thread)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from qcluster import App, Client, Job
from qcluster.broker import open_broker
from qcluster.errors import ConfigError
from qcluster.slot.runtime import SlotRunner
from tests.conftest import wait_until


def run_until(runner: SlotRunner, predicate: Callable[[], object],
              timeout_s: float = 60.0) -> None:
    def loop() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            runner.step()
            if predicate():
                return
        raise AssertionError("slot did not reach the expected state in time")

    with ThreadPoolExecutor(1) as pool:
        pool.submit(loop).result()


def make_runner(app: App, queue: str, url: str) -> SlotRunner:
    return SlotRunner(app, queue, open_broker(url))


def settled(client: Client, queue: str) -> None:
    wait_until(lambda: client.stats(queue)["locked"] == 0, timeout_s=60, message="settled")


def test_async_batch_handler_retry_fail_and_done(broker_url: str, queue_name: str) -> None:
    app = App()
    seen: list[str] = []

    @app.queue(queue_name, batch_size=10)
    async def handle(jobs: list[Job]) -> None:
        for job in jobs:
            await asyncio.sleep(0)  # a real await between jobs
            seen.append(f"{job.payload}:{job.attempts}")
            if job.payload == "fail":
                job.fail("not today")
            elif job.payload == "retry" and job.attempts == 1:
                job.retry(0.2)

    client = Client(broker_url)
    client.enqueue_many(queue_name, ["ok", "retry", "fail"])
    run_until(make_runner(app, queue_name, broker_url), lambda: "retry:2" in seen)
    settled(client, queue_name)
    assert sorted(seen) == ["fail:1", "ok:1", "retry:1", "retry:2"]
    assert client.stats(queue_name) == {"ready": 0, "locked": 0, "delayed": 0, "dead": 1}
    assert client.dead_jobs(queue_name)[0].reason == "not today"


def test_async_handler_that_raises_is_retried_with_backoff_then_dead_lettered(
    broker_url: str, queue_name: str
) -> None:
    app = App()
    attempts: list[int] = []
    base, cap = (2.0, 4.0) if broker_url.startswith("amqp") else (0.2, 1.0)

    @app.queue(queue_name, max_attempts=3, retry_base_delay=base, retry_max_delay=cap)
    async def explode(jobs: list[Job]) -> None:
        attempts.append(jobs[0].attempts)
        await asyncio.sleep(0)
        raise ValueError("database said no")

    client = Client(broker_url)
    client.enqueue(queue_name, {"n": 1})
    run_until(make_runner(app, queue_name, broker_url),
              lambda: client.stats(queue_name)["dead"] == 1)
    assert attempts == [1, 2, 3]
    (dead,) = client.dead_jobs(queue_name)
    assert "ValueError: database said no" in dead.reason and "attempt 3 of 3" in dead.reason


def test_async_per_job_handler_runs_up_to_concurrency_jobs_at_once(
    broker_url: str, queue_name: str
) -> None:
    """Each job waits (a bounded while) for ``concurrency`` jobs to be in flight: the
    recorded maximum is exactly the limit, never more, whatever the machine's speed."""
    app = App()
    limit, in_flight, peaks, done = 5, [0], [0], []

    @app.job_queue(queue_name, batch_size=20, concurrency=limit)
    async def handle(job: Job) -> None:
        in_flight[0] += 1
        peaks[0] = max(peaks[0], in_flight[0])
        try:
            for _ in range(100):  # up to ~1 s: a partial batch (RabbitMQ) has fewer jobs
                if in_flight[0] >= limit:
                    break
                await asyncio.sleep(0.01)
            done.append(job.payload)
        finally:
            in_flight[0] -= 1

    client = Client(broker_url)
    client.enqueue_many(queue_name, list(range(60)))
    run_until(make_runner(app, queue_name, broker_url), lambda: len(done) == 60)
    settled(client, queue_name)
    assert sorted(done) == list(range(60))
    assert peaks[0] == limit, f"at most {limit} jobs at once, and {limit} reached: {peaks[0]}"
    assert client.stats(queue_name) == {"ready": 0, "locked": 0, "delayed": 0, "dead": 0}


def test_async_per_job_handler_without_concurrency_runs_the_whole_batch_at_once(
    redis_url: str, queue_name: str
) -> None:
    app = App()
    in_flight, peaks, all_in = [0], [0], asyncio.Event()

    @app.job_queue(queue_name, batch_size=30)
    async def handle(job: Job) -> None:
        in_flight[0] += 1
        peaks[0] = max(peaks[0], in_flight[0])
        if in_flight[0] == 30:
            all_in.set()
        await all_in.wait()  # only returns once all 30 are in flight together

    client = Client(redis_url)
    client.enqueue_many(queue_name, list(range(30)))
    run_until(make_runner(app, queue_name, redis_url),
              lambda: client.stats(queue_name)["ready"] == 0)
    settled(client, queue_name)
    assert peaks[0] == 30
    assert client.stats(queue_name) == {"ready": 0, "locked": 0, "delayed": 0, "dead": 0}


def test_an_exception_in_one_concurrent_job_loses_none_of_the_others(
    broker_url: str, queue_name: str
) -> None:
    app = App()
    finished: list[int] = []

    @app.job_queue(queue_name, batch_size=10, concurrency=10, max_attempts=2,
                   retry_base_delay=0.1, retry_max_delay=0.1)
    async def handle(job: Job) -> None:
        await asyncio.sleep(0.01 * (job.payload % 3))
        if job.payload == 4:
            raise RuntimeError("job 4 broke")
        if job.payload == 7 and job.attempts == 1:
            job.retry(0.1)
        finished.append(job.payload)

    client = Client(broker_url)
    client.enqueue_many(queue_name, list(range(10)))
    run_until(make_runner(app, queue_name, broker_url),
              lambda: finished.count(7) == 2 and client.stats(queue_name)["dead"] == 1)
    settled(client, queue_name)
    assert sorted(finished) == [0, 1, 2, 3, 5, 6, 7, 7, 8, 9]
    (dead,) = client.dead_jobs(queue_name)
    assert dead.reason == ("attempt 2 of 2 raised and no attempt is left (max_attempts 2): "
                           "last error RuntimeError: job 4 broke")
    assert client.stats(queue_name) == {"ready": 0, "locked": 0, "delayed": 0, "dead": 1}


def test_a_job_awaiting_forever_is_cancelled_at_the_deadline_and_the_slot_goes_on(
    broker_url: str, queue_name: str
) -> None:
    """batch_timeout 1 s: the hung job's coroutine is cancelled (its finally runs), it is
    settled like an exception (max_attempts 1: dead-lettered with the reason), its batch-mates
    that finished are acked, and the same slot then runs the next job."""
    app = App()
    finished: list[str] = []
    cancelled: list[str] = []

    @app.job_queue(queue_name, batch_size=5, batch_timeout=1.0, max_attempts=1)
    async def handle(job: Job) -> None:
        try:
            if job.payload == "hang":
                await asyncio.Event().wait()  # never set
            finished.append(job.payload)
        except asyncio.CancelledError:
            cancelled.append(job.payload)
            raise

    client = Client(broker_url)
    client.enqueue_many(queue_name, ["a", "hang", "b"])
    runner = make_runner(app, queue_name, broker_url)
    run_until(runner, lambda: client.stats(queue_name)["dead"] == 1)
    assert cancelled == ["hang"]
    (dead,) = client.dead_jobs(queue_name)
    assert dead.reason.endswith("last error TimeoutError: async batch cancelled after 0.8s "
                                "(batch_timeout)")
    client.enqueue(queue_name, "after")
    run_until(runner, lambda: "after" in finished)
    settled(client, queue_name)
    assert sorted(finished) == ["a", "after", "b"]
    assert client.stats(queue_name) == {"ready": 0, "locked": 0, "delayed": 0, "dead": 1}


def test_a_cancelled_batch_handler_keeps_the_outcomes_it_gave_and_retries_the_rest(
    redis_url: str, queue_name: str
) -> None:
    app = App()
    runs: list[tuple[str, int]] = []

    @app.queue(queue_name, batch_size=3, batch_timeout=1.0, max_attempts=3,
               retry_base_delay=0.1, retry_max_delay=0.1)
    async def handle(jobs: list[Job]) -> None:
        for job in jobs:
            runs.append((job.payload, job.attempts))
            if job.payload == "bad":
                job.fail("refused before the hang")
        if any(job.payload == "slow" and job.attempts == 1 for job in jobs):
            await asyncio.sleep(3600)

    client = Client(redis_url)
    client.enqueue_many(queue_name, ["bad", "slow", "ok"])
    runner = make_runner(app, queue_name, redis_url)
    # The two retried jobs come back at jittered times, possibly in separate batches.
    run_until(runner, lambda: {("slow", 2), ("ok", 2)} <= set(runs)
              and client.stats(queue_name)["locked"] == 0)
    settled(client, queue_name)
    assert sorted(runs) == [("bad", 1), ("ok", 1), ("ok", 2), ("slow", 1), ("slow", 2)]
    (dead,) = client.dead_jobs(queue_name)
    assert dead.reason == "refused before the hang", "the failed job was not run again"
    assert client.stats(queue_name) == {"ready": 0, "locked": 0, "delayed": 0, "dead": 1}


def test_on_error_lock_leaves_a_cancelled_job_locked_as_a_killed_sync_slot_would(
    redis_url: str, queue_name: str
) -> None:
    app = App()

    @app.queue(queue_name, on_error="lock", lock_timeout=5.0, batch_timeout=0.5)
    async def hang(jobs: list[Job]) -> None:
        await asyncio.sleep(3600)

    client = Client(redis_url)
    client.enqueue(queue_name, {"n": 1})
    runner = make_runner(app, queue_name, redis_url)
    with ThreadPoolExecutor(1) as pool:
        pool.submit(runner.step).result()
    assert client.stats(queue_name)["locked"] == 1
    wait_until(lambda: client.stats(queue_name)["ready"] == 1, timeout_s=60,
               message="lock expiry")
    client.purge(queue_name)


def test_concurrency_is_validated_and_refused_where_it_would_do_nothing() -> None:
    app = App()
    for bad in (0, -1, 2_001, 1.5, "ten"):
        with pytest.raises(ConfigError, match="concurrency"):
            app.job_queue("q", concurrency=bad)(_each)
    with pytest.raises(ConfigError, match="concurrency applies only to async per-job"):
        app.queue("q", concurrency=4)(_batch)
    with pytest.raises(ConfigError, match="concurrency applies only to async per-job"):
        app.job_queue("q", concurrency=4)(lambda job: None)
    app.job_queue("q", concurrency=4)(_each)
    assert app.spec("q").policy.concurrency == 4
    merged = app.with_overrides({"q": {"concurrency": 7}})
    assert merged.spec("q").policy.concurrency == 7
    with pytest.raises(ConfigError, match=r"\[queues.b\].*concurrency applies only"):
        app.queue("b")(_batch)
        app.with_overrides({"b": {"concurrency": 2}})


def test_async_generators_are_refused_at_registration() -> None:
    async def stream(jobs: list[Job]) -> AsyncIterator[None]:
        yield None

    with pytest.raises(ConfigError, match="async generator"):
        App().queue("q")(stream)


async def _each(job: Job) -> None: ...


async def _batch(jobs: list[Job]) -> None: ...
