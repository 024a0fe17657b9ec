"""The manager's HTTP API in-process (FastAPI TestClient) on a real Redis broker: the
report round trip, the cluster JSON shape, the token, the Host check, /metrics."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from qcluster.admin_ui.source import ClusterSource
from qcluster.broker import open_broker
from qcluster.config import load_settings
from qcluster.manager.api.app import create_app
from qcluster.manager.planning.plan import MAX_HOLD_ROUNDS
from qcluster.manager.service import ManagerService
from qcluster.manager.state import ClusterState
from qcluster.metrics import MANAGER_GAUGES, MANAGER_METRICS, MANAGER_QUEUE_GAUGES
from tests.unit.test_manager_state import report

AUTH = {"Authorization": "Bearer s3cret"}


@pytest.fixture
def service(redis_url: str) -> Iterator[ManagerService]:
    broker = open_broker(redis_url)
    yield ManagerService(ClusterState(load_settings(None)), broker, "s3cret")
    broker.close()


@pytest.fixture
def client(service: ManagerService) -> TestClient:
    return TestClient(create_app(service), base_url="http://127.0.0.1")


def test_service_is_an_admin_ui_cluster_source(service: ManagerService) -> None:
    source: ClusterSource = service  # mypy checks the protocol
    assert source.check_token("s3cret") and not source.check_token("nope")
    assert not source.check_token(None)


def test_report_round_trip_and_cluster_shape(client: TestClient, service: ManagerService,
                                            queue_name: str) -> None:
    policies = {queue_name: report("x", {}).queues["mail"]}
    body = report("a", {queue_name: 1}, queues=policies).model_dump(mode="json")
    reply = client.post("/api/v1/reports", json=body, headers=AUTH)
    assert reply.status_code == 200 and reply.json()["row"] == {queue_name: 1}
    service.round()  # one planning round against the real broker (empty queue)
    view = client.get("/api/v1/cluster").json()
    queue = next(q for q in view["queues"] if q["name"] == queue_name)
    for _ in range(MAX_HOLD_ROUNDS):  # an idle queue's slot is released after the hold
        service.round()
    view = client.get("/api/v1/cluster").json()
    assert {"name", "priority", "min_slots", "max_slots", "slots_current", "slots_planned",
            "load", "backlog", "locked", "delayed", "dead", "rate_in", "rate_out",
            "mean_job_seconds"} <= set(queue)
    assert queue["backlog"] == 0 and queue["slots_current"] == 1
    assert {"name", "capacity_slots", "slots", "mem_available_bytes", "loadavg",
            "last_report_at", "alive"} <= set(view["hosts"][0])
    assert view["slot_map"] == {"a": {}}  # idle, minimum 0: shrinks to nothing
    assert view["decisions"][0]["from"] == 1 and view["decisions"][0]["to"] == 0


@pytest.mark.parametrize("path", ["/api/v1/queues/q/pause", "/api/v1/queues/q/resume",
                                  "/api/v1/queues/q/requeue-dead", "/api/v1/hosts/h/drain"])
def test_mutating_endpoints_need_the_token(client: TestClient, path: str) -> None:
    assert client.post(path).status_code == 401
    assert client.post(path, headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_pause_and_drain_with_the_token(client: TestClient, service: ManagerService,
                                        queue_name: str) -> None:
    assert client.post(f"/api/v1/queues/{queue_name}/pause", headers=AUTH).json()["paused"]
    assert queue_name in service.state.paused
    assert client.post(f"/api/v1/queues/{queue_name}/resume", headers=AUTH).status_code == 200
    assert queue_name not in service.state.paused
    assert client.post("/api/v1/hosts/h9/drain", headers=AUTH).json()["drained"]
    assert client.post(f"/api/v1/queues/{queue_name}/requeue-dead",
                       headers=AUTH).json()["requeued"] == 0


def test_loopback_manager_refuses_foreign_host_headers(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/healthz", headers={"Host": "evil.example"}).status_code == 400


def test_metrics_and_openapi(client: TestClient, service: ManagerService) -> None:
    client.post("/api/v1/reports", json=report("a", {"mail": 1}).model_dump(mode="json"),
                headers=AUTH)
    service.state.plan_round(service.clock())
    text = client.get("/metrics").text
    for name in MANAGER_METRICS:
        assert f"# TYPE {name} gauge" in text, name
    helps = {**{n: doc for n, (doc, _) in MANAGER_QUEUE_GAUGES.items()}, **MANAGER_GAUGES}
    for name, doc in helps.items():  # names and help texts from their one definition
        assert f"# HELP {name} {doc}" in text, name
    assert 'qcluster_host_up{host="a"} 1.0' in text
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/api/v1/reports", "/api/v1/cluster", "/healthz", "/metrics"} <= set(paths)
