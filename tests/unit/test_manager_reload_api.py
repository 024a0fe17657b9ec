"""The manager's reload routes in-process (FastAPI TestClient, a real Redis broker behind the
service): the token (401, the token's name recorded), 404 / 409, the id each host's reply
carries as the rollout moves on from the reports, the ``reload`` section and the hosts'
``code`` in /api/v1/cluster, the decision log, and a restarted manager sending ""."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from fastapi.testclient import TestClient

from qcluster.config import load_settings
from qcluster.manager.api.app import create_app
from qcluster.manager.service import ManagerService
from qcluster.manager.state import ClusterState
from qcluster.messages import CodeInfo, ReloadState
from tests.unit.test_manager_state import report

TOKEN = "unit-reload-7c1e3a5b9d2f4a6c"
OPS_TOKEN = "unit-reload-ops-4b6d8f0a2c4e6a8c"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
OPS = {"Authorization": f"Bearer {OPS_TOKEN}"}


@dataclass
class Manager:
    service: ManagerService
    client: TestClient
    now: list[float]

    def report(self, host: str, reload_id: str = "", state: ReloadState = "idle", *,
               version: str = "v1", generation: int = 0, error: str = "") -> str:
        """The host reports its code; returns the reload id the manager's reply carries."""
        code = CodeInfo(version=version, generation=generation, state=state, error=error,
                        reload_id=reload_id)
        body = report(host, {"mail": 1}).model_copy(update={"code": code})
        reply = self.client.post("/api/v1/reports", json=body.model_dump(mode="json"),
                                 headers=AUTH)
        assert reply.status_code == 200, reply.text
        return str(reply.json()["reload_id"])

    def reload(self, path: str = "/api/v1/reload", headers: dict[str, str] = OPS) -> Any:
        return self.client.post(path, headers=headers)


def serve(broker_url: str, now: list[float]) -> Manager:
    from qcluster.broker import open_broker

    service = ManagerService(ClusterState(load_settings(None)), open_broker(broker_url), TOKEN,
                             clock=lambda: now[0], tokens={"ops": OPS_TOKEN})
    return Manager(service, TestClient(create_app(service), base_url="http://127.0.0.1"), now)


@pytest.fixture
def manager(redis_url: str) -> Iterator[Manager]:
    served = serve(redis_url, [1000.0])
    yield served
    served.service.broker.close()


@pytest.mark.parametrize("path", ["/api/v1/reload", "/api/v1/hosts/a/reload"])
def test_reload_needs_a_valid_token(manager: Manager, path: str) -> None:
    manager.report("a")
    assert manager.client.post(path).status_code == 401
    assert manager.reload(path, {"Authorization": "Bearer wrong"}).status_code == 401
    assert manager.service.reload_status() is None  # nothing started
    assert manager.report("a") == ""


def test_unknown_host_404_not_reporting_or_nobody_409(manager: Manager) -> None:
    assert manager.reload().status_code == 409  # no host has reported
    assert manager.reload("/api/v1/hosts/nobody/reload").status_code == 404
    assert manager.reload("/api/v1/hosts/bad%20name/reload").status_code == 422
    manager.report("a")
    manager.now[0] += 3600  # a's report expired
    reply = manager.reload("/api/v1/hosts/a/reload")
    assert reply.status_code == 409 and "not reporting" in reply.json()["detail"]


def test_one_host_reload_round_trip(manager: Manager) -> None:
    manager.report("a")
    manager.report("b")
    reply = manager.reload("/api/v1/hosts/a/reload")
    assert reply.status_code == 200, reply.text
    rollout = reply.json()
    assert rollout["by"] == "ops" and rollout["state"] == "running"
    assert [h["host"] for h in rollout["hosts"]] == ["a"]
    reload_id = rollout["hosts"][0]["reload_id"]
    assert manager.report("a") == reload_id and manager.report("b") == ""
    busy = manager.reload("/api/v1/hosts/b/reload")
    assert busy.status_code == 409 and "is running" in busy.json()["detail"]
    manager.report("a", reload_id, "loading")
    manager.service.advance_reload()
    assert manager.client.get("/api/v1/reload").json()["hosts"][0]["state"] == "asked"
    manager.report("a", reload_id, version="v2", generation=1)
    manager.service.round()  # the planning round moves the rollout on
    done = manager.client.get("/api/v1/reload").json()
    assert done["state"] == "done" and done["hosts"][0]["state"] == "took"
    assert done["hosts"][0]["note"] == "version v1 -> v2, generation 1"
    assert manager.report("a", reload_id) == reload_id  # the id stays: nothing new to do


def test_all_hosts_one_at_a_time_and_the_cluster_view(manager: Manager) -> None:
    for host in ("b", "a", "c"):
        manager.report(host)
    rollout = manager.reload().json()
    assert [h["host"] for h in rollout["hosts"]] == ["a", "b", "c"]
    first = rollout["hosts"][0]["reload_id"]
    assert [manager.report(h) for h in ("a", "b", "c")] == [first, "", ""]
    manager.report("a", first, "rolling")
    manager.service.advance_reload()
    assert manager.report("b") == ""  # b waits while a rolls
    view = manager.client.get("/api/v1/cluster").json()
    assert view["reload"]["id"] == rollout["id"]
    assert [h["state"] for h in view["reload"]["hosts"]] == ["asked", "waiting", "waiting"]
    code = {h["name"]: h["code"] for h in view["hosts"]}
    assert code["a"]["state"] == "rolling" and code["a"]["reload_id"] == first
    manager.report("a", first, version="v2", generation=1)
    manager.service.advance_reload()
    second = manager.report("b")
    assert second not in ("", first)
    manager.report("b", second, "failed", error="ImportError: no module named <x>")
    manager.service.advance_reload()
    stopped = manager.client.get("/api/v1/reload").json()
    assert stopped["state"] == "stopped"
    assert [h["state"] for h in stopped["hosts"]] == ["took", "failed", "waiting"]
    assert manager.report("c") == ""  # c keeps the old code
    reasons = [d["reason"] for d in manager.client.get("/api/v1/cluster").json()["decisions"]]
    assert reasons[:5] == [
        "reload stopped: b failed: ImportError: no module named <x>; not asked, still on the "
        "old code: c",
        "reload b: failed, ImportError: no module named <x>",
        "reload b: asked",
        "reload a: took, version v1 -> v2, generation 1",
        "reload a: asked",
    ]
    assert manager.reload().status_code == 200  # a stopped rollout no longer blocks


def test_a_restarted_manager_asks_no_host_to_reload(manager: Manager, redis_url: str) -> None:
    manager.report("a")
    manager.reload()
    assert manager.report("a") != ""
    restarted = serve(redis_url, manager.now)  # a new process: its memory starts empty
    try:
        assert restarted.report("a", "whatever-it-did-last") == ""
        assert restarted.client.get("/api/v1/reload").json() is None
        assert restarted.client.get("/api/v1/cluster").json()["reload"] is None
    finally:
        restarted.service.broker.close()


def test_openapi_lists_the_reload_routes(manager: Manager) -> None:
    paths = manager.client.get("/openapi.json").json()["paths"]
    assert {"/api/v1/reload", "/api/v1/hosts/{host}/reload"} <= set(paths)


def test_a_drained_host_is_reloaded_too_and_an_expired_one_is_not(manager: Manager) -> None:
    manager.report("old")
    manager.now[0] += 3600  # "old" stopped reporting long ago
    manager.report("a")
    manager.report("d")
    manager.service.drain("d")  # no slot planned, but its master runs: new code for later
    try:
        rollout = manager.reload().json()
        assert [h["host"] for h in rollout["hosts"]] == ["a", "d"]
    finally:
        manager.service.undrain("d")  # the session's Redis is shared with other tests
