"""One ``Client`` shared by a producer's threads (a web server's request threads) and by the
processes it forks (a preloading server's workers), on real Redis and RabbitMQ: every job
arrives and no call fails. A RabbitMQ connection serves one thread at a time; shared, the
threads' frames interleaved and every one of them failed with the broker 'unreachable'.
Once closed, a Client says so (ClientClosed) in any thread, instead of quietly opening
connections nobody will close."""

from __future__ import annotations

import os
import uuid

import pytest

from qcluster import Client
from qcluster.app import App
from qcluster.errors import ClientClosed
from tests.contract.test_rabbitmq_quorum import queue_types
from tests.threads import run_in_threads

THREADS = 8
PER_THREAD = 150


@pytest.fixture(params=["redis", "rabbitmq"])
def url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(f"{request.param}_url"))


def test_threads_sharing_one_client_enqueue_every_job(url: str) -> None:
    queue = f"threads-{uuid.uuid4().hex[:8]}"
    with Client(url) as client:

        def produce() -> None:
            for n in range(PER_THREAD):
                client.enqueue(queue, {"n": n})
                if n % 50 == 0:
                    client.stats(queue)

        errors = run_in_threads(produce, THREADS, timeout_s=120)
        try:
            assert not errors
            assert client.stats(queue)["ready"] == THREADS * PER_THREAD
        finally:
            client.purge(queue)


def test_a_forked_child_enqueues_through_its_parents_client(url: str) -> None:
    queue = f"forked-{uuid.uuid4().hex[:8]}"
    with Client(url) as client:
        client.enqueue(queue, {"from": "parent"})  # the parent's connection is open
        pid = os.fork()
        if pid == 0:  # the child: exit status 0 only when all of its jobs were taken
            try:
                client.enqueue_many(queue, [{"from": "child"}] * 20)
                os._exit(0)
            except BaseException:
                os._exit(1)
        client.enqueue(queue, {"from": "parent"})  # while the child may use its own
        _, status = os.waitpid(pid, 0)
        try:
            assert os.waitstatus_to_exitcode(status) == 0
            client.enqueue(queue, {"from": "parent"})  # the parent's link is intact
            assert client.stats(queue)["ready"] == 23
        finally:
            client.purge(queue)


def test_another_thread_declares_the_queue_as_the_app_says(rabbitmq_url: str) -> None:
    queue = f"thread-quorum-{uuid.uuid4().hex[:8]}"
    app = App()
    app.queue(queue, queue_type="quorum", max_attempts=4)(lambda jobs: None)
    with Client(rabbitmq_url, app=app) as client:
        errors = run_in_threads(lambda: client.enqueue(queue, {"n": 1}), 1, timeout_s=60)
        try:
            assert not errors
            assert queue_types(queue).get(queue) == "quorum"
        finally:
            client.broker.delete_queue(queue)


def test_a_closed_client_refuses_every_call_in_every_thread(url: str) -> None:
    queue = f"closed-{uuid.uuid4().hex[:8]}"
    with Client(url) as client:
        client.enqueue(queue, {"n": 1})
        client.purge(queue)
    with pytest.raises(ClientClosed, match="closed"):
        client.enqueue(queue, {"n": 2})
    with pytest.raises(ClientClosed):
        client.stats(queue)
    errors = run_in_threads(lambda: client.enqueue(queue, {"n": 3}), 1, timeout_s=30)
    assert [type(error) for error in errors] == [ClientClosed]
    client.close()  # closing again is harmless
