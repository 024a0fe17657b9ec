"""A closed ``Client`` says so: a call after ``close()`` (or after its ``with`` block) raises
ClientClosed in any thread, instead of quietly opening connections nobody will close."""

from __future__ import annotations

import uuid

import pytest

from qcluster import Client
from qcluster.errors import ClientClosed
from tests.threads import run_in_threads


@pytest.fixture(params=["redis", "rabbitmq"])
def url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(f"{request.param}_url"))


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
