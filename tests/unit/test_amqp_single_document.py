"""A one-document RabbitMQ queue (qcluster.broker.amqp_single) on a real RabbitMQ: of
several processes that find the queue missing at once, exactly one creates it. Each
creator starts from an empty document, so two creators meant one writer's change (a
pause, a drain) replaced by the other's."""

from __future__ import annotations

import threading
import uuid

from kombu import Connection

from qcluster.broker.amqp_single import SingleDocumentQueue
from tests.threads import run_in_threads

OPENERS = 4


def test_of_openers_that_find_no_queue_exactly_one_creates_it(rabbitmq_url: str) -> None:
    queue = f"qc~test-document-{uuid.uuid4().hex[:8]}"
    all_looked = threading.Barrier(OPENERS)
    created: list[bool] = []

    def open_it() -> None:
        with Connection(rabbitmq_url) as conn:
            all_looked.wait(30)
            channel, was_created = SingleDocumentQueue(conn, queue, 5).open()
            created.append(was_created)
            channel.close()

    errors = run_in_threads(open_it, OPENERS, timeout_s=60)
    with Connection(rabbitmq_url) as conn:
        conn.default_channel.queue_delete(queue)
    assert not errors
    assert sorted(created) == [False] * (OPENERS - 1) + [True]
