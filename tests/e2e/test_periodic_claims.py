"""Periodic jobs' claims on every backend (qcluster.broker: claim_tick, unclaim_tick,
last_ticks): of two managers claiming the same tick, one wins; an earlier tick never wins
again; the record survives the claimer (a new connection reads it)."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator

import pytest

from qcluster.broker import open_broker
from qcluster.broker.base import Broker
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


def test_a_tick_is_claimed_once_and_earlier_ticks_never(broker_url: str, job_name: str) -> None:
    with opened(broker_url) as first, opened(broker_url) as second:
        assert first.claim_tick(job_name, 1_000) is True
        assert second.claim_tick(job_name, 1_000) is False
        assert first.claim_tick(job_name, 1_000) is False
        assert second.claim_tick(job_name, 500) is False
        assert first.claim_tick(job_name, 2_000) is True
        assert first.last_ticks()[job_name] == 2_000
        assert second.last_ticks()[job_name] == 2_000


def test_the_record_outlives_the_claimer(broker_url: str, job_name: str) -> None:
    with opened(broker_url) as first:
        assert first.claim_tick(job_name, 5_000)
    with opened(broker_url) as restarted:
        assert restarted.last_ticks()[job_name] == 5_000
        assert restarted.claim_tick(job_name, 5_000) is False
        assert restarted.claim_tick(job_name, 6_000) is True


def test_unclaim_gives_the_tick_back(broker_url: str, job_name: str) -> None:
    with opened(broker_url) as broker:
        assert broker.claim_tick(job_name, 1_000)
        assert broker.claim_tick(job_name, 2_000)
        broker.unclaim_tick(job_name, 2_000, 1_000)
        assert broker.last_ticks()[job_name] == 1_000
        broker.unclaim_tick(job_name, 2_000, None)  # no longer its claim: nothing changes
        assert broker.last_ticks()[job_name] == 1_000
        assert broker.claim_tick(job_name, 2_000)


def test_racing_claimers_win_each_tick_once(broker_url: str, job_name: str) -> None:
    """Four connections claim the same 50 ticks at once: each tick has one winner."""
    wins: list[list[int]] = [[] for _ in range(4)]
    brokers = [open_broker(broker_url) for _ in wins]
    start = threading.Barrier(len(wins))

    def claim_all(index: int) -> None:
        start.wait()
        for tick in range(1, 51):
            if brokers[index].claim_tick(job_name, tick * 1000):
                wins[index].append(tick)

    threads = [threading.Thread(target=claim_all, args=(i,)) for i in range(len(wins))]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    finally:
        for broker in brokers:
            broker.close()
    claimed = sorted(tick for won in wins for tick in won)
    assert claimed == sorted(set(claimed)), "a tick was claimed twice"
    assert claimed[-1] == 50


def test_rabbitmq_one_connection_claims_until_it_closes(rabbitmq_url: str,
                                                        job_name: str) -> None:
    """RabbitMQ has no compare-and-set: the connection holding the exclusive lock queue
    claims, another claims nothing (not even a later tick) until that one closes, then
    takes over from the ledger the first wrote."""
    with opened(rabbitmq_url) as second:
        with opened(rabbitmq_url) as first:
            assert first.claim_tick(job_name, 1_000)
            assert second.claim_tick(job_name, 2_000) is False
            assert second.last_ticks()[job_name] == 1_000  # a peek at the ledger
            assert first.claim_tick(job_name, 2_000)
        assert second.claim_tick(job_name, 2_000) is False  # the ledger says 2_000
        assert second.claim_tick(job_name, 3_000) is True


def test_rabbitmq_a_new_holder_claims_nothing_while_the_ledger_is_held_elsewhere(
        rabbitmq_url: str, job_name: str) -> None:
    """The holder dies while a third manager, stalled mid-peek, holds the ledger's document
    (the ledger looks empty). The next holder claims nothing until the document is back,
    then goes on from it: no tick claimed twice, no other job's record lost (before, it
    started from an empty record after half a second)."""
    from qcluster.broker.amqp_periodic import LEDGER_QUEUE
    from qcluster.broker.kombu_broker import KombuBroker

    other_job = f"{job_name}-other"
    with opened(rabbitmq_url) as second, opened(rabbitmq_url) as stalled:
        assert isinstance(stalled, KombuBroker)
        with opened(rabbitmq_url) as first:
            assert first.claim_tick(job_name, 1_000) and first.claim_tick(job_name, 2_000)
            assert first.claim_tick(other_job, 5_000)
            stalled.ping()
            reader = stalled.conn.channel()
            assert reader.basic_get(LEDGER_QUEUE, no_ack=False) is not None
        try:  # first is gone: its lock with it
            assert second.claim_tick(job_name, 2_000) is False  # enqueued by first
            assert second.claim_tick(job_name, 3_000) is False  # not before the ledger is back
        finally:
            reader.close()  # the stalled manager lets go: the document comes back
        wait_until(lambda: second.claim_tick(job_name, 3_000),
                   message="the next holder claims once the ledger is back")
        assert second.claim_tick(job_name, 2_000) is False
        assert second.claim_tick(other_job, 5_000) is False  # first's record was kept
        assert second.last_ticks() == {**second.last_ticks(), job_name: 3_000,
                                       other_job: 5_000}
