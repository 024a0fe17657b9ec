"""Contract tests leave nothing behind on the shared brokers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from qcluster.broker import open_broker


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
