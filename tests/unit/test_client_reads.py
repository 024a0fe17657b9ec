"""A producer's reads (stats, dead letters, requeue, purge, a job by id) of a queue that does
not exist, on real Redis and RabbitMQ: they answer "empty" and create nothing. On RabbitMQ
all but ``stats`` used to declare the queue: a misspelt name stayed in the broker, and a
queue read before its slots started was fixed as classic, so an app declaring it as a
quorum queue was refused (QueueTypeMismatch)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest

from qcluster import Client
from qcluster.app import App
from tests.contract.test_rabbitmq_quorum import queue_types

READS: dict[str, Callable[[Client, str], Any]] = {
    "stats": lambda client, queue: client.stats(queue),
    "dead_jobs": lambda client, queue: client.dead_jobs(queue),
    "requeue_dead": lambda client, queue: client.requeue_dead(queue),
    "purge": lambda client, queue: client.purge(queue),
    "job": lambda client, queue: client.job("a" * 32, queue=queue).state,
}
EMPTY = {"stats": {"ready": 0, "locked": 0, "delayed": 0, "dead": 0}, "dead_jobs": [],
         "requeue_dead": 0, "purge": 0, "job": "unknown"}


@pytest.fixture(params=["redis", "rabbitmq"])
def url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(f"{request.param}_url"))


def _exists(url: str, queue: str) -> bool:
    """Whether the broker holds ``queue`` (RabbitMQ: a passive declare, as no client of
    this process used it; Redis: its registry of queues)."""
    with Client(url) as client:
        if url.startswith("amqp"):
            return bool(queue_types(queue))
        return queue in client.queues()


@pytest.mark.parametrize("read", sorted(READS))
def test_a_read_of_a_missing_queue_answers_empty_and_creates_nothing(url: str,
                                                                     read: str) -> None:
    queue = f"never-{uuid.uuid4().hex[:8]}"
    with Client(url) as client:
        assert READS[read](client, queue) == EMPTY[read]
    assert not _exists(url, queue)


def test_a_queue_read_before_its_app_declares_it_becomes_quorum(rabbitmq_url: str) -> None:
    queue = f"read-first-{uuid.uuid4().hex[:8]}"
    with Client(rabbitmq_url) as tooling:  # an operator's look before the slots start
        for read in READS.values():
            read(tooling, queue)
    app = App()
    app.queue(queue, queue_type="quorum")(lambda jobs: None)
    with Client(rabbitmq_url, app=app) as producer:
        try:
            producer.enqueue(queue, {"n": 1})
            assert queue_types(queue).get(queue) == "quorum"
        finally:
            producer.broker.delete_queue(queue)
