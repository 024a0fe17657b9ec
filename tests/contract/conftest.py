"""Contract tests leave nothing behind on the shared brokers; they run on every backend of
tests/conftest.py and on RabbitMQ quorum queues too."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from qcluster.broker import open_broker
from tests.conftest import BACKENDS

#: The contract suite's extra variant: every queue a quorum queue (``?queue_type=quorum``).
RABBITMQ_QUORUM = "rabbitmq-quorum"


def with_query(url: str, option: str) -> str:
    """``url`` with one more query option (every URL of a ``;``-joined list)."""
    return ";".join(f"{one}{'&' if '?' in one else '?'}{option}" for one in url.split(";"))


@pytest.fixture
def rabbitmq_quorum_url(rabbitmq_url: str) -> str:
    return with_query(rabbitmq_url, "queue_type=quorum")


@pytest.fixture(params=[*BACKENDS, RABBITMQ_QUORUM])
def broker_url(request: pytest.FixtureRequest) -> str:
    """Each contract test runs once per backend: the backend NAME's URL is fixture
    ``NAME_url`` (``rabbitmq-quorum``: :func:`rabbitmq_quorum_url`)."""
    return str(request.getfixturevalue(f"{request.param.replace('-', '_')}_url"))


@pytest.fixture(autouse=True)
def _delete_test_queue(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test, delete its unique queue (RabbitMQ: also its delay ladder)."""
    names = request.fixturenames
    url_fixture = next((n for n in ("broker_url", "redis_url") if n in names), None)
    if url_fixture is None or "queue_name" not in names:
        yield
        return
    # Resolved before the test: fixtures it uses are torn down before this one.
    url, queue = request.getfixturevalue(url_fixture), request.getfixturevalue("queue_name")
    yield
    broker = open_broker(url)
    try:
        delete = getattr(broker, "delete_queue", None)
        if delete is not None:
            delete(queue)
    finally:
        broker.close()
