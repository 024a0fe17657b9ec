"""The manager's job routes: a lookup by id, a page of a queue's
jobs in one state, dead letters requeued and deleted by id with the token, against a real
broker behind the manager's FastAPI app."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from qcluster.broker import Settlement, open_broker
from qcluster.config import load_settings
from qcluster.failures import JobError
from qcluster.manager.api.app import create_app
from qcluster.manager.service import ManagerService
from qcluster.manager.state import ClusterState
from tests.contract.test_job_lookup import body, take

TOKEN = "jobs-api-token-3f9a"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def api(broker_url: str) -> Iterator[TestClient]:
    broker = open_broker(broker_url)
    service = ManagerService(ClusterState(load_settings(None)), broker, TOKEN)
    with TestClient(create_app(service), base_url="http://127.0.0.1") as client:
        yield client
    broker.close()


def dead_letters(broker_url: str, queue: str, ids: list[str]) -> None:
    broker = open_broker(broker_url)
    try:
        broker.publish_many(queue, [(job_id, body(queue, job_id, {"n": job_id}))
                                    for job_id in ids])
        taken = take(broker, queue, len(ids))
        error = JobError.bounded(type="ValueError", message="bad", traceback="Traceback\n",
                                 host="h", slot="1", attempt=1, at=time.time())
        broker.settle(queue, Settlement(dead=[(d, "raised ValueError") for d in taken],
                                        errors={d.id: error for d in taken}))
    finally:
        broker.close()


def test_lookup_listing_and_per_job_actions(api: TestClient, broker_url: str,
                                            queue_name: str) -> None:
    dead_letters(broker_url, queue_name, ["a1", "a2", "a3"])
    if broker_url.startswith("amqp"):
        # RabbitMQ cannot list a broker's queues: the manager looks in the ones it has
        # used (the apps' queues, once masters report; here a listing).
        api.get(f"/api/v1/queues/{queue_name}/jobs", params={"state": "dead"})
    found = api.get("/api/v1/jobs/a2")
    assert found.status_code == 200, found.text
    job = found.json()
    assert job["state"] == "dead" and job["queue"] == queue_name
    assert job["payload"] == {"n": "a2"} and job["reason"] == "raised ValueError"
    assert job["last_error"]["type"] == "ValueError"
    page = api.get(f"/api/v1/queues/{queue_name}/jobs",
                   params={"state": "dead", "limit": 2}).json()
    assert page["total"] == 3 and len(page["jobs"]) == 2 and page["limit"] == 2
    assert api.post(f"/api/v1/queues/{queue_name}/dead/delete",
                    json={"ids": ["a1"]}).status_code == 401
    deleted = api.post(f"/api/v1/queues/{queue_name}/dead/delete", json={"ids": ["a1"]},
                       headers=AUTH)
    assert deleted.json() == {"deleted": 1}
    requeued = api.post(f"/api/v1/queues/{queue_name}/dead/requeue", json={"ids": ["a2"]},
                        headers=AUTH)
    assert requeued.json() == {"requeued": 1}
    assert api.post(f"/api/v1/queues/{queue_name}/dead/requeue", json={"all": True},
                    headers=AUTH).json() == {"requeued": 1}
    assert api.get(f"/api/v1/queues/{queue_name}/jobs",
                   params={"state": "dead"}).json()["total"] == 0


def test_dead_letters_are_listed_in_the_order_each_backend_keeps(
        api: TestClient, broker_url: str, queue_name: str) -> None:
    """The job browser's page and ``qcluster dead`` (dead_page) list the newest dead
    letter first on Redis and the embedded broker, the oldest first on RabbitMQ (its store
    is a queue: a page reads only the letters up to its end), with a note saying so; the
    queue page's list (dead_jobs) is newest first everywhere. Fails on the code before on
    RabbitMQ, whose pages read the whole store to list it newest first."""
    for job_id in ("n1", "n2", "n3"):  # one settle each: n3 is the newest
        dead_letters(broker_url, queue_name, [job_id])
    rabbit = broker_url.startswith("amqp")
    order = ["n1", "n2", "n3"] if rabbit else ["n3", "n2", "n1"]
    listed = api.get(f"/api/v1/queues/{queue_name}/jobs", params={"state": "dead"}).json()
    assert [job["id"] for job in listed["jobs"]] == order
    assert listed["note"] == (
        "RabbitMQ keeps dead letters in a queue: listed oldest first" if rabbit else None)
    broker = open_broker(broker_url)
    try:
        assert [d.id for d in broker.dead_jobs(queue_name)] == ["n3", "n2", "n1"]
        total, page = broker.dead_page(queue_name, offset=0, limit=2)
        assert total == 3 and [d.id for d in page] == order[:2]
        assert [d.id for d in broker.dead_page(queue_name, offset=2, limit=2)[1]] == order[2:]
    finally:
        broker.close()


def test_unknown_ids_and_bad_requests(api: TestClient, broker_url: str) -> None:
    missing = api.get("/api/v1/jobs/no-such-job")
    if broker_url.startswith("amqp"):
        assert missing.status_code in (200, 404)
        if missing.status_code == 200:
            assert missing.json()["state"] == "unknown" and missing.json()["note"]
    else:
        assert missing.status_code == 404 and "no job no-such-job" in missing.json()["detail"]
    assert api.get("/api/v1/queues/q/jobs", params={"state": "finished"}).status_code == 422
    assert api.get("/api/v1/queues/q/jobs",
                   params={"state": "dead", "limit": 501}).status_code == 422
    assert api.post("/api/v1/queues/q/dead/delete", json={}, headers=AUTH).status_code == 422


@pytest.mark.parametrize("sent", [{"id": ["b1"]}, None, {}, {"all": False},
                                  {"ids": ["b1"], "all": True}, {"ids": ["b1"], "x": 1}])
def test_requeue_all_needs_all_true(api: TestClient, broker_url: str, queue_name: str,
                                    sent: object) -> None:
    """A misspelt field, a null body or an empty one is refused (422), never read as
    "requeue every dead letter"."""
    dead_letters(broker_url, queue_name, ["b1", "b2"])
    refused = api.post(f"/api/v1/queues/{queue_name}/dead/requeue", json=sent, headers=AUTH)
    assert refused.status_code == 422, refused.text
    page = api.get(f"/api/v1/queues/{queue_name}/jobs", params={"state": "dead"}).json()
    assert page["total"] == 2
    assert api.post(f"/api/v1/queues/{queue_name}/dead/delete",
                    json={"ids": ["b1"], "all": True}, headers=AUTH).status_code == 422
