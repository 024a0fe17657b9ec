"""Periodic ticks and publishing an id again on Redis past one server (Sentinel, Cluster):
the same promises as on one Redis (test_tick_idempotence.py), through ``WAIT`` and, on a
Cluster, the tick's record in the queue's hash slot and the periodic records in another."""

from __future__ import annotations

import contextlib
import uuid

import pytest

from qcluster.broker import Settlement, open_broker
from tests.contract.test_contract_redis_ha import (  # noqa: F401 (fixtures)
    broker_url,
    redis_cluster,
    redis_sentinel,
)
from tests.contract.test_tick_idempotence import TICK_WAIT_S, taken_ticks
from tests.e2e.test_periodic_claims import tick


@pytest.fixture
def job_name() -> str:
    return f"p-{uuid.uuid4().hex[:10]}"


def test_a_tick_is_enqueued_once_however_often_it_is_published(
        broker_url: str, queue_name: str, job_name: str) -> None:  # noqa: F811
    with contextlib.closing(open_broker(broker_url)) as first, \
            contextlib.closing(open_broker(broker_url)) as second:
        assert tick(first, queue_name, job_name, 1_000) is True
        assert tick(second, queue_name, job_name, 1_000) is False
        assert taken_ticks(first, queue_name, wait_s=TICK_WAIT_S) == [1_000]
        assert tick(second, queue_name, job_name, 1_000) is False  # finished: still refused
        assert tick(second, queue_name, job_name, 500) is False
        assert tick(second, queue_name, job_name, 2_000) is True
        assert taken_ticks(first, queue_name, wait_s=TICK_WAIT_S) == [2_000]
        assert first.last_ticks()[job_name] == 2_000


def test_publishing_a_locked_id_again_changes_nothing(
        broker_url: str, queue_name: str) -> None:  # noqa: F811
    with contextlib.closing(open_broker(broker_url)) as broker:
        assert broker.publish_many(queue_name, [("job-1", b"1")]) == ["job-1"]
        [taken] = broker.take(queue_name, max_jobs=10, lock_timeout_s=60)
        assert broker.publish_many(queue_name, [("job-1", b"2"), ("job-2", b"3")]) == ["job-2"]
        [other] = broker.take(queue_name, max_jobs=10, lock_timeout_s=60)
        assert other.id == "job-2"
        broker.settle(queue_name, Settlement(ack=[taken, other]))
        assert broker.stats(queue_name).model_dump() == {
            "ready": 0, "locked": 0, "delayed": 0, "dead": 0}
