"""Periodic ticks on every backend (``Broker.publish_tick``, ``last_ticks``): a tick is
enqueued once however often and by however many connections it is published; an earlier
tick never again; the record survives the publisher (a new connection reads it)."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator

import pytest

from qcluster.broker import open_broker
from qcluster.broker.base import Broker
from qcluster.job import decode_envelope
from qcluster.manager.planning.periodic import TICK_HEADER
from tests.conftest import wait_until


@pytest.fixture
def job_name() -> str:
    return f"p-{uuid.uuid4().hex[:10]}"


@contextlib.contextmanager
def opened(url: str) -> Iterator[Broker]:
    broker = open_broker(url)
    try:
        yield broker
    finally:
        broker.close()


def tick(broker: Broker, queue: str, job: str, tick_ms: int) -> bool:
    body = b'{"id": "%s", "queue": "%s", "payload": null, "enqueued_at": 0, ' \
           b'"headers": {"%s": "%d"}}' % (f"periodic.{job}.{tick_ms}".encode(),
                                         queue.encode(), TICK_HEADER.encode(), tick_ms)
    return broker.publish_tick(queue, job, tick_ms, f"periodic.{job}.{tick_ms}", body)


def enqueued(broker: Broker, queue: str) -> list[int]:
    """The ticks of the queue's jobs, taken and acked (duplicates kept)."""
    ticks = []
    while batch := broker.take(queue, max_jobs=100, lock_timeout_s=60, wait_s=0.5):
        ticks += [int(decode_envelope(d.body).headers[TICK_HEADER]) for d in batch]
        broker.ack(queue, batch)
    return sorted(ticks)


def test_a_tick_is_enqueued_once_and_earlier_ticks_never(
        broker_url: str, job_name: str, queue_name: str) -> None:
    with opened(broker_url) as first, opened(broker_url) as second:
        assert tick(first, queue_name, job_name, 1_000) is True
        assert tick(second, queue_name, job_name, 1_000) is False
        assert tick(first, queue_name, job_name, 1_000) is False
        assert tick(second, queue_name, job_name, 500) is False
        assert tick(first, queue_name, job_name, 2_000) is True
        assert first.last_ticks()[job_name] == 2_000
        assert second.last_ticks()[job_name] == 2_000
        assert enqueued(first, queue_name) == [1_000, 2_000]


def test_a_tick_whose_job_finished_is_not_enqueued_again(
        broker_url: str, job_name: str, queue_name: str) -> None:
    """The record, not the job, says the tick is enqueued: its job taken and acked, the
    tick published again stores nothing."""
    with opened(broker_url) as broker:
        assert tick(broker, queue_name, job_name, 1_000)
        assert enqueued(broker, queue_name) == [1_000]
        assert tick(broker, queue_name, job_name, 1_000) is False
        assert enqueued(broker, queue_name) == []


def test_the_record_outlives_the_publisher(broker_url: str, job_name: str,
                                          queue_name: str) -> None:
    with opened(broker_url) as first:
        assert tick(first, queue_name, job_name, 5_000)
    with opened(broker_url) as restarted:
        assert restarted.last_ticks()[job_name] == 5_000
        assert tick(restarted, queue_name, job_name, 5_000) is False
        assert tick(restarted, queue_name, job_name, 6_000) is True
        assert enqueued(restarted, queue_name) == [5_000, 6_000]


def test_racing_publishers_enqueue_each_tick_once(broker_url: str, job_name: str,
                                                 queue_name: str) -> None:
    """Four connections publish the same 50 ticks at once: each tick is enqueued once."""
    wins: list[list[int]] = [[] for _ in range(4)]
    brokers = [open_broker(broker_url) for _ in wins]
    start = threading.Barrier(len(wins))

    def publish_all(index: int) -> None:
        start.wait()
        for n in range(1, 51):
            if tick(brokers[index], queue_name, job_name, n * 1000):
                wins[index].append(n)

    threads = [threading.Thread(target=publish_all, args=(i,)) for i in range(len(wins))]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        stored = sorted(n for won in wins for n in won)
        assert stored == sorted(set(stored)), "a tick was enqueued twice"
        assert stored[-1] == 50
        assert enqueued(brokers[0], queue_name) == [n * 1000 for n in stored]
    finally:
        for broker in brokers:
            broker.close()


def test_rabbitmq_one_connection_enqueues_until_it_closes(
        rabbitmq_url: str, job_name: str, queue_name: str) -> None:
    """RabbitMQ has no compare-and-set: the connection holding the exclusive lock queue
    enqueues, another enqueues nothing (not even a later tick) until that one closes,
    then takes over from the record the first left."""
    with opened(rabbitmq_url) as second:
        with opened(rabbitmq_url) as first:
            assert tick(first, queue_name, job_name, 1_000)
            assert tick(second, queue_name, job_name, 2_000) is False
            assert second.last_ticks()[job_name] == 1_000  # a peek at the ledger
            assert tick(first, queue_name, job_name, 2_000)
        assert tick(second, queue_name, job_name, 2_000) is False  # recorded: 2_000
        assert tick(second, queue_name, job_name, 3_000) is True
        assert enqueued(second, queue_name) == [1_000, 2_000, 3_000]


def test_rabbitmq_the_receipt_stands_when_the_ledger_missed_it(
        rabbitmq_url: str, job_name: str, queue_name: str) -> None:
    """A manager killed between a tick's publish and its ledger write: the next holder
    reads the job's receipt queue (which the publish reached with the job) and does not
    enqueue the tick again."""
    from qcluster.broker.kombu_broker import KombuBroker

    with opened(rabbitmq_url) as first:
        assert tick(first, queue_name, job_name, 1_000)
        assert isinstance(first, KombuBroker)
        ledger = first.periodic  # what a kill before the write leaves: the old record
        ledger._write({**ledger._ticks, job_name: 0})
        assert first.last_ticks()[job_name] == 0
    with opened(rabbitmq_url) as restarted:
        assert restarted.last_ticks()[job_name] == 0  # the ledger alone (a peek)
        assert tick(restarted, queue_name, job_name, 1_000) is False
        assert restarted.last_ticks()[job_name] == 1_000  # written back from the receipt
        assert enqueued(restarted, queue_name) == [1_000]


def test_rabbitmq_a_new_holder_enqueues_nothing_while_the_ledger_is_held_elsewhere(
        rabbitmq_url: str, job_name: str, queue_name: str) -> None:
    """The holder dies while a third manager, stalled mid-peek, holds the ledger's document
    (the ledger looks empty). The next holder enqueues nothing until the document is back,
    then goes on from it: no tick enqueued twice, no other job's record lost."""
    from qcluster.broker.amqp_periodic import LEDGER_QUEUE
    from qcluster.broker.kombu_broker import KombuBroker

    other_job = f"{job_name}-other"
    with opened(rabbitmq_url) as second, opened(rabbitmq_url) as stalled:
        assert isinstance(stalled, KombuBroker)
        with opened(rabbitmq_url) as first:
            assert tick(first, queue_name, job_name, 1_000)
            assert tick(first, queue_name, job_name, 2_000)
            assert tick(first, queue_name, other_job, 5_000)
            stalled.ping()
            reader = stalled.conn.channel()
            assert reader.basic_get(LEDGER_QUEUE, no_ack=False) is not None
        try:  # first is gone: its lock with it
            assert tick(second, queue_name, job_name, 2_000) is False  # enqueued by first
            assert tick(second, queue_name, job_name, 3_000) is False  # ledger not back
        finally:
            reader.close()  # the stalled manager lets go: the document comes back
        wait_until(lambda: tick(second, queue_name, job_name, 3_000),
                   message="the next holder enqueues once the ledger is back")
        assert tick(second, queue_name, job_name, 2_000) is False
        assert tick(second, queue_name, other_job, 5_000) is False  # first's record kept
        assert second.last_ticks() == {**second.last_ticks(), job_name: 3_000,
                                       other_job: 5_000}
        assert enqueued(second, queue_name) == [1_000, 2_000, 3_000, 5_000]
