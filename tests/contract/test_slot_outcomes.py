"""What a slot does with each outcome, on every backend (DESIGN sections 2-3)."""

from __future__ import annotations

import itertools
import pickle
import random
import time
from pathlib import Path

import pytest

from qcluster import App, Client, Job
from qcluster.broker import open_broker
from qcluster.slot.runtime import SlotRunner
from tests.conftest import wait_until


def run_until(runner: SlotRunner, predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        runner.step()
        if predicate():
            return
    raise AssertionError("slot did not reach the expected state in time")


def make_runner(app: App, queue: str, url: str) -> SlotRunner:
    return SlotRunner(app, queue, open_broker(url))


class TopOfJitter(random.Random):
    """Retry delays without jitter: each is the top of its range (base x 2**(n-1))."""

    def random(self) -> float:
        return 1.0 - 1e-9


def test_handler_that_raises_is_retried_with_backoff_then_dead_lettered(
    broker_url: str, queue_name: str
) -> None:
    app = App()
    calls: list[tuple[int, float]] = []
    # RabbitMQ's delay ladder counts whole seconds (rounded up): sub-second backoff
    # steps are indistinguishable there, so it gets steps of seconds.
    base, cap = (2.0, 4.0) if broker_url.startswith("amqp") else (0.2, 1.0)

    @app.queue(queue_name, max_attempts=3, retry_base_delay=base, retry_max_delay=cap)
    def explode(jobs: list[Job]) -> None:
        calls.append((jobs[0].attempts, time.monotonic()))
        raise ValueError("database said no")

    client = Client(broker_url)
    client.enqueue(queue_name, {"n": 1})
    runner = make_runner(app, queue_name, broker_url)
    runner.rand = TopOfJitter()  # the retries come back base and 2 x base later
    run_until(runner, lambda: client.stats(queue_name)["dead"] == 1)

    assert [attempt for attempt, _ in calls] == [1, 2, 3]
    gaps = [b - a for (_, a), (_, b) in itertools.pairwise(calls)]
    # A retry never comes before its delay; it may come any time later on a busy machine,
    # so each gap is checked against its own delay, not against the other gap. The second
    # delay is twice the first: a backoff that did not grow would bring it back early.
    assert gaps[0] >= 0.9 * base and gaps[1] >= 0.9 * 2 * base, f"backoff gaps {gaps}"
    (dead,) = client.dead_jobs(queue_name)
    assert "ValueError: database said no" in dead.reason
    assert "attempt 3 of 3 raised and no attempt is left (max_attempts 3)" in dead.reason
    assert client.stats(queue_name) == {"ready": 0, "locked": 0, "delayed": 0, "dead": 1}
    client.purge(queue_name)


def test_per_job_outcomes_retry_fail_and_done(broker_url: str, queue_name: str) -> None:
    app = App()
    seen: list[str] = []

    @app.queue(queue_name, batch_size=10)
    def handle(jobs: list[Job]) -> None:
        for job in jobs:
            seen.append(f"{job.payload}:{job.attempts}")
            if job.payload == "fail":
                job.fail("not today")
            elif job.payload == "retry" and job.attempts == 1:
                job.retry(0.2)

    client = Client(broker_url)
    client.enqueue_many(queue_name, ["ok", "retry", "fail"])
    runner = make_runner(app, queue_name, broker_url)
    run_until(runner, lambda: "retry:2" in seen)
    wait_until(lambda: client.stats(queue_name)["locked"] == 0, timeout_s=60, message="settled")
    assert sorted(seen) == ["fail:1", "ok:1", "retry:1", "retry:2"]
    assert client.stats(queue_name) == {"ready": 0, "locked": 0, "delayed": 0, "dead": 1}
    assert client.dead_jobs(queue_name)[0].reason == "not today"


def test_on_error_lock_leaves_jobs_locked_until_the_lock_expires(
    redis_url: str, queue_name: str
) -> None:
    app = App()

    # A 5 s lock: still held when a busy CPU reads the stats after the step.
    @app.queue(queue_name, on_error="lock", lock_timeout=5.0, batch_timeout=0.5)
    def explode(jobs: list[Job]) -> None:
        raise RuntimeError("leave it")

    client = Client(redis_url)
    client.enqueue(queue_name, {"n": 1})
    runner = make_runner(app, queue_name, redis_url)
    runner.step()
    assert client.stats(queue_name)["locked"] == 1
    wait_until(lambda: client.stats(queue_name)["ready"] == 1, timeout_s=60, message="lock expiry")
    client.purge(queue_name)


def test_malformed_and_pickle_messages_are_dead_lettered_never_unpickled(
    broker_url: str, queue_name: str, tmp_path: Path
) -> None:
    # A pickle that would create a file if anything ever unpickled it.
    marker = tmp_path / "unpickled"

    class Exploit:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            import os

            return (os.system, (f"touch {marker}",))

    app = App()
    handled: list[object] = []

    @app.queue(queue_name, batch_size=10, max_message_bytes=1024)
    def handle(jobs: list[Job]) -> None:
        handled.extend(job.payload for job in jobs)

    broker = open_broker(broker_url)
    broker.publish(queue_name, "pickle", pickle.dumps(Exploit()))
    broker.publish(queue_name, "garbage", b"{not json")
    broker.publish(queue_name, "wrong-shape", b'{"hello": "world"}')
    broker.publish(queue_name, "huge", b'{"pad": "' + b"x" * 2048 + b'"}')
    client = Client(broker_url)
    client.enqueue(queue_name, "fine")
    runner = make_runner(app, queue_name, broker_url)
    run_until(runner, lambda: client.stats(queue_name)["dead"] == 4)

    assert handled == ["fine"], "the slot went on with the valid job"
    assert not marker.exists(), "a pickle was deserialized"
    reasons = {d.id: d.reason for d in client.dead_jobs(queue_name)}
    assert set(reasons) == {"pickle", "garbage", "wrong-shape", "huge"}
    assert reasons["huge"].startswith("oversized")
    assert all(r.startswith(("malformed", "oversized")) for r in reasons.values())
    client.purge(queue_name)


def test_client_refuses_oversized_and_non_json_payloads(redis_url: str, queue_name: str) -> None:
    from qcluster.errors import EnvelopeError

    client = Client(redis_url, max_message_bytes=200)
    with pytest.raises(EnvelopeError, match="over the 200-byte limit"):
        client.enqueue(queue_name, "x" * 500)
    with pytest.raises(EnvelopeError, match="not JSON"):
        client.enqueue(queue_name, {"when": object()})
    assert client.stats(queue_name)["ready"] == 0


def test_small_batches_of_a_fast_handler_are_prefetched_but_run_batch_size_at_a_time(
    broker_url: str, queue_name: str
) -> None:
    app = App()
    batches: list[list[int]] = []

    @app.queue(queue_name, batch_size=2)
    def handle(jobs: list[Job]) -> None:
        batches.append([job.payload for job in jobs])

    client = Client(broker_url)
    client.enqueue_many(queue_name, list(range(40)))
    runner = make_runner(app, queue_name, broker_url)
    takes = 0
    deadline = time.monotonic() + 60
    while sum(map(len, batches)) < 40 and time.monotonic() < deadline:
        takes += runner.step()
    assert sorted(n for batch in batches for n in batch) == list(range(40))
    assert all(len(batch) <= 2 for batch in batches), "a handler got more than batch_size"
    assert takes < 20, f"{takes} takes for 40 jobs: several batches must come per take"
    wait_until(lambda: client.stats(queue_name)["locked"] == 0, timeout_s=60, message="settled")
    assert client.stats(queue_name) == {"ready": 0, "locked": 0, "delayed": 0, "dead": 0}
