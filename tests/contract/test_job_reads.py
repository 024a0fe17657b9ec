"""The job routes' reads on RabbitMQ, against a real RabbitMQ behind the manager's app:
a lookup or a dead page never holds the broker lock the planning round, the periodic
ticker and the controls share, reads a bounded number of letters (a page past the bound
is empty with a note saying why, never a wrong state), and lookups beyond the bound on
concurrent reads are refused (429) rather than queued."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from httpx import Response

from qcluster.broker import amqp_jobs, open_broker
from qcluster.config import load_settings
from qcluster.manager.api.app import create_app
from qcluster.manager.service import ManagerService
from qcluster.manager.state import ClusterState
from tests.contract.test_jobs_api import AUTH, TOKEN, dead_letters

#: How long a test waits for a blocked read to start or finish.
WAIT_S = 60.0


@pytest.fixture
def service(rabbitmq_url: str) -> Iterator[ManagerService]:
    broker = open_broker(rabbitmq_url)
    yield ManagerService(ClusterState(load_settings(None)), broker, TOKEN)
    broker.close()


class Held:
    """Makes the next dead-letter reads wait until released (a slow lookup)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered, self.released = threading.Event(), threading.Event()
        real = amqp_jobs.read_dead

        def slow(*args: Any) -> list[Any]:
            self.entered.set()
            self.released.wait(WAIT_S)
            return real(*args)

        monkeypatch.setattr(amqp_jobs, "read_dead", slow)


def in_thread(api: TestClient, path: str, answers: list[Response]) -> threading.Thread:
    thread = threading.Thread(target=lambda: answers.append(api.get(path)), daemon=True)
    thread.start()
    return thread


def test_a_slow_lookup_leaves_the_shared_broker_lock_free(
        service: ManagerService, rabbitmq_url: str, queue_name: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    dead_letters(rabbitmq_url, queue_name, ["c1"])
    with TestClient(create_app(service), base_url="http://127.0.0.1") as api:
        api.get(f"/api/v1/queues/{queue_name}/jobs", params={"state": "dead"})  # a known queue
        held, answers = Held(monkeypatch), []
        looking = in_thread(api, "/api/v1/jobs/no-such-job", answers)
        try:
            assert held.entered.wait(WAIT_S)
            free = service.broker_lock.acquire(timeout=10)  # held for the whole read before
            if free:
                service.broker_lock.release()
                paused = api.post(f"/api/v1/queues/{queue_name}/pause", headers=AUTH)
                assert paused.status_code == 200, paused.text
        finally:
            held.released.set()
            looking.join(WAIT_S)
        assert free, "the lookup held the broker lock the round, ticker and controls share"
        assert answers[0].status_code == 200 and answers[0].json()["state"] == "unknown"


def test_lookups_beyond_the_bound_are_refused_not_queued(
        service: ManagerService, rabbitmq_url: str, queue_name: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from qcluster.manager.job_reads import JobReads

    service.job_reads = JobReads(lambda: service.broker, max_reads=1)
    dead_letters(rabbitmq_url, queue_name, ["d1"])
    with TestClient(create_app(service), base_url="http://127.0.0.1") as api:
        api.get(f"/api/v1/queues/{queue_name}/jobs", params={"state": "dead"})
        held, answers = Held(monkeypatch), []
        looking = in_thread(api, "/api/v1/jobs/d1", answers)
        try:
            assert held.entered.wait(WAIT_S)
            refused = api.get("/api/v1/jobs/d1")
        finally:
            held.released.set()
            looking.join(WAIT_S)
        assert refused.status_code == 429 and "try again" in refused.json()["detail"]
        assert answers[0].json()["state"] == "dead"


def test_pages_and_lookups_read_at_most_the_bound(
        service: ManagerService, rabbitmq_url: str, queue_name: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(amqp_jobs, "READ_LIMIT", 20, raising=False)
    ids = [f"e{n:02d}" for n in range(30)]
    dead_letters(rabbitmq_url, queue_name, ids)
    with TestClient(create_app(service), base_url="http://127.0.0.1") as api:
        def page(offset: int, limit: int) -> dict[str, Any]:
            answer = api.get(f"/api/v1/queues/{queue_name}/jobs",
                             params={"state": "dead", "offset": offset, "limit": limit})
            assert answer.status_code == 200, answer.text
            return dict(answer.json())

        # Oldest first, each page reading only the letters up to its end: the pages that
        # reach past the 20th letter say that the later ones cannot be listed.
        first = page(0, 10)
        assert [job["id"] for job in first["jobs"]] == ids[:10] and first["total"] == 30
        assert first["note"] == "RabbitMQ keeps dead letters in a queue: listed oldest first"
        straddling = page(15, 10)
        assert [job["id"] for job in straddling["jobs"]] == ids[15:20]
        assert straddling["note"].startswith("RabbitMQ keeps dead letters in a queue: "
                                             "listed oldest first")
        assert "at most 20 letters" in straddling["note"]
        beyond = page(25, 5)
        assert beyond["jobs"] == [] and beyond["total"] == 30
        assert "at most 20 letters" in beyond["note"]
        assert api.get(f"/api/v1/jobs/{ids[5]}").json()["state"] == "dead"
        late = api.get(f"/api/v1/jobs/{ids[25]}").json()
        assert late["state"] == "unknown" and "at most 20 dead letters" in late["note"]
        assert queue_name in late["note"] and "not a dead letter" not in late["note"]


def test_a_page_reads_only_the_letters_up_to_its_end(
        service: ManagerService, rabbitmq_url: str, queue_name: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A page of the store reads ``offset + limit`` letters, not the whole store (one
    round trip per letter, under the manager's broker lock for the queue page), and gives
    them back. Fails on the code before, whose pages read the whole store."""
    ids = [f"r{n:02d}" for n in range(30)]
    dead_letters(rabbitmq_url, queue_name, ids)
    reads: list[int] = []
    real = amqp_jobs.read_dead

    def counted(channel: Any, queue: str, limit: int) -> list[Any]:
        letters = real(channel, queue, limit)
        reads.append(len(letters))
        return letters

    monkeypatch.setattr(amqp_jobs, "read_dead", counted)
    with TestClient(create_app(service), base_url="http://127.0.0.1") as api:
        for _ in range(2):  # the second page sees the letters the first gave back
            listed = api.get(f"/api/v1/queues/{queue_name}/jobs",
                             params={"state": "dead", "offset": 5, "limit": 5}).json()
            assert [job["id"] for job in listed["jobs"]] == ids[5:10]
            assert listed["total"] == 30
    assert reads == [10, 10]
