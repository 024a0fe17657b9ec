"""The queue-server contract, one suite run against every backend (DESIGN section 2)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from qcluster.broker import Broker, Settlement, open_broker
from tests.conftest import wait_until


@pytest.fixture
def broker(broker_url: str, queue_name: str) -> Iterator[Broker]:
    opened = open_broker(broker_url)
    yield opened
    opened.purge(queue_name)
    opened.close()


def publish(broker: Broker, queue: str, count: int, *, delay_s: float = 0.0) -> list[str]:
    ids = [f"job-{i}-{time.monotonic_ns()}" for i in range(count)]
    broker.publish_many(queue, [(i, b'{"n": 1}') for i in ids], delay_s=delay_s)
    return ids


def take_all(broker: Broker, queue: str, expected: int, *, lock_s: float = 30.0,
             timeout_s: float = 60.0) -> list:
    """Take until ``expected`` deliveries came (RabbitMQ streams them in)."""
    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < expected and time.monotonic() < deadline:
        got += broker.take(queue, max_jobs=expected - len(got), lock_timeout_s=lock_s, wait_s=0.5)
    return got


def test_published_jobs_are_counted_ready(broker: Broker, queue_name: str) -> None:
    publish(broker, queue_name, 5)
    wait_until(lambda: broker.stats(queue_name).ready == 5, timeout_s=60, message="5 ready")
    assert broker.stats(queue_name).model_dump() == {
        "ready": 5, "locked": 0, "delayed": 0, "dead": 0
    }
    assert queue_name in broker.queues()


def test_take_returns_at_most_max_jobs_and_locks_them(broker: Broker, queue_name: str) -> None:
    ids = publish(broker, queue_name, 10)
    first = take_all(broker, queue_name, 4)
    assert len(first) == 4
    assert all(d.attempts == 1 for d in first)
    assert {d.id for d in first} <= set(ids)
    stats = broker.stats(queue_name)
    assert stats.locked == 4 and stats.ready == 6
    rest = take_all(broker, queue_name, 6)
    assert {d.id for d in first + rest} == set(ids), "a locked job was handed out twice"


def test_an_idle_take_whose_wait_ends_within_a_millisecond_returns_empty(
        broker: Broker, queue_name: str) -> None:
    """An idle slot polls with a short wait, and a poll often ends a hair before its
    deadline. Redis 6.2 (the embedded broker's) reads a block of 0.001 s as no timeout at
    all: the slot stalled until its socket timed out and logged the broker unreachable."""
    for _ in range(5):
        assert broker.take(queue_name, max_jobs=1, lock_timeout_s=5.0, wait_s=0.001) == []


def test_ack_deletes_the_whole_batch(broker: Broker, queue_name: str) -> None:
    publish(broker, queue_name, 20)
    batch = take_all(broker, queue_name, 20)
    broker.ack(queue_name, batch)
    wait_until(lambda: broker.stats(queue_name).locked == 0, timeout_s=60, message="acked")
    assert broker.stats(queue_name).model_dump() == {
        "ready": 0, "locked": 0, "delayed": 0, "dead": 0
    }
    assert broker.take(queue_name, max_jobs=10, lock_timeout_s=5, wait_s=0.3) == []


def test_jobs_of_a_consumer_that_went_away_come_back(
    broker_url: str, broker: Broker, queue_name: str
) -> None:
    # Given a consumer that took jobs with a short lock and then vanished
    # (Redis: the lock expires; RabbitMQ: its connection closes)
    ids = publish(broker, queue_name, 3)
    crashed = open_broker(broker_url)
    taken = take_all(crashed, queue_name, 3, lock_s=0.5)
    assert len(taken) == 3
    crashed.close()
    # Then another consumer gets them, with the attempt counted (RabbitMQ cannot tell
    # which of a dead consumer's jobs ran: none is charged, each comes back suspect)
    again = take_all(broker, queue_name, 3)
    assert {d.id for d in again} == set(ids)
    amqp = broker_url.startswith("amqp")
    assert all((d.attempts, d.suspect) == (1, True) if amqp else d.attempts == 2 for d in again)


def test_every_consumer_death_counts_as_an_attempt(
    broker_url: str, broker: Broker, queue_name: str
) -> None:
    # A job that kills its slot every time must reach max_attempts, not loop forever.
    # (RabbitMQ: the first death of a job not yet suspect is not charged; it runs alone.)
    (job_id,) = publish(broker, queue_name, 1)
    for expected in (1, 1, 2) if broker_url.startswith("amqp") else (1, 2):
        crashed = open_broker(broker_url)
        (delivery,) = take_all(crashed, queue_name, 1, lock_s=0.5)
        assert (delivery.id, delivery.attempts) == (job_id, expected)
        crashed.close()
    (again,) = take_all(broker, queue_name, 1)
    assert (again.id, again.attempts) == (job_id, 3)


def test_delayed_job_is_not_taken_before_its_activation_time(
    broker: Broker, queue_name: str
) -> None:
    publish(broker, queue_name, 1, delay_s=3.0)  # still delayed when a busy CPU checks
    start = time.monotonic()
    assert broker.take(queue_name, max_jobs=1, lock_timeout_s=5, wait_s=0.5) == []
    wait_until(lambda: broker.stats(queue_name).delayed == 1, timeout_s=60, message="delayed=1")
    got = take_all(broker, queue_name, 1)
    elapsed = time.monotonic() - start
    assert len(got) == 1
    assert elapsed >= 2.9, f"delayed job came after {elapsed:.2f}s, before its 3s delay"


def test_postponed_job_comes_back_after_its_delay(broker: Broker, queue_name: str) -> None:
    publish(broker, queue_name, 1)
    (delivery,) = take_all(broker, queue_name, 1)
    start = time.monotonic()
    broker.postpone(queue_name, delivery, 3.0)  # still postponed when a busy CPU checks
    assert broker.take(queue_name, max_jobs=1, lock_timeout_s=5, wait_s=0.3) == []
    (again,) = take_all(broker, queue_name, 1)
    assert again.id == delivery.id
    assert again.attempts == 2
    assert time.monotonic() - start >= 2.9


def test_dead_letter_keeps_reason_and_requeue_brings_jobs_back(
    broker: Broker, queue_name: str
) -> None:
    publish(broker, queue_name, 2)
    batch = take_all(broker, queue_name, 2)
    broker.settle(queue_name, Settlement(dead=[(d, "boom: bad input") for d in batch]))
    wait_until(lambda: broker.stats(queue_name).dead == 2, timeout_s=60, message="2 dead")
    stats = broker.stats(queue_name)
    assert (stats.ready, stats.locked) == (0, 0)
    dead = broker.dead_jobs(queue_name, limit=10)
    assert {d.id for d in dead} == {d.id for d in batch}
    assert all(d.reason == "boom: bad input" and d.attempts == 1 for d in dead)
    assert broker.dead_jobs(queue_name, limit=10), "listing must not consume dead jobs"

    assert broker.requeue_dead(queue_name) == 2
    again = take_all(broker, queue_name, 2)
    assert {d.id for d in again} == {d.id for d in batch}
    assert all(d.attempts == 1 for d in again), "requeue resets attempts"
    assert broker.stats(queue_name).dead == 0


def test_mixed_settlement_in_one_call(broker: Broker, queue_name: str) -> None:
    publish(broker, queue_name, 3)
    a, b, c = take_all(broker, queue_name, 3)
    broker.settle(queue_name, Settlement(ack=[a], postpone=[(b, 30.0)], dead=[(c, "no")]))
    wait_until(
        lambda: broker.stats(queue_name).model_dump()
        == {"ready": 0, "locked": 0, "delayed": 1, "dead": 1},
        timeout_s=60, message="ready 0, locked 0, delayed 1, dead 1",
    )


def test_purge_removes_waiting_jobs(broker: Broker, queue_name: str) -> None:
    publish(broker, queue_name, 7)
    wait_until(lambda: broker.stats(queue_name).ready == 7, timeout_s=60, message="7 ready")
    assert broker.purge(queue_name) == 7
    assert broker.stats(queue_name).ready == 0


def test_body_bytes_come_back_untouched(broker: Broker, queue_name: str) -> None:
    body = '{"text": "héllo \\u2603", "n": [1, 2.5, null]}'.encode()
    broker.publish(queue_name, "exact", body)
    (delivery,) = take_all(broker, queue_name, 1)
    assert delivery.body == body
    assert delivery.content_type == "application/json"
