"""Issue 15, defect 1: nobody without the token steers the cluster. The manager's API
probed in-process (FastAPI TestClient) on a real Redis broker with bad input: no token,
NaN, infinity, huge figures, wrong types, too many queues, a body above 1 MiB, a foreign
Host header. Every answer is a 4xx, never a 500. (The shared checks themselves:
test_listen_security.py.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from qcluster.broker import open_broker
from qcluster.config import load_settings
from qcluster.manager.api.app import create_app
from qcluster.manager.service import ManagerService
from qcluster.manager.state import ClusterState
from tests.unit.test_manager_state import report

TOKEN = "9f2c4e6a8b0d1f3e5a7c9b1d"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


# --- the API ---------------------------------------------------------------------


@pytest.fixture
def service(redis_url: str) -> Iterator[ManagerService]:
    broker = open_broker(redis_url)
    yield ManagerService(ClusterState(load_settings(None)), broker, TOKEN)
    broker.close()


@pytest.fixture
def client(service: ManagerService) -> TestClient:
    return TestClient(create_app(service), base_url="http://127.0.0.1",
                      raise_server_exceptions=False)


def good_report(host: str = "a", **changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = report(host, {"mail": 1}).model_dump(mode="json")
    body.update(changes)
    return body


def post_raw(client: TestClient, body: str, headers: dict[str, str] | None = None) -> int:
    return client.post("/api/v1/reports", content=body.encode(),
                       headers={"Content-Type": "application/json", **(headers or AUTH)}
                       ).status_code


def test_reports_need_the_token(client: TestClient) -> None:
    assert client.post("/api/v1/reports", json=good_report()).status_code == 401
    assert client.post("/api/v1/reports", json=good_report(),
                       headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.post("/api/v1/reports", json=good_report(), headers=AUTH).status_code == 200


def test_without_a_token_only_a_loopback_manager_takes_reports(redis_url: str) -> None:
    broker = open_broker(redis_url)
    try:
        service = ManagerService(ClusterState(load_settings(None)), broker, None)
        local = TestClient(create_app(service, loopback=True), base_url="http://127.0.0.1")
        assert local.post("/api/v1/reports", json=good_report()).status_code == 200
        public = TestClient(create_app(service, loopback=False), base_url="http://10.0.0.1")
        assert public.post("/api/v1/reports", json=good_report()).status_code == 401
    finally:
        broker.close()


def nested(body: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    *parents, last = path.split(".")
    node = body
    for key in parents:
        node = node[key]
    node[last] = value
    return body


@pytest.mark.parametrize(("path", "value"), [
    ("interval_s", 1e12), ("interval_s", 0), ("interval_s", -1), ("interval_s", "soon"),
    ("capacity_slots", 10**12), ("capacity_slots", -1), ("sent_at", 1e300),
    ("generation", -5), ("host", "evil host"), ("host", "[/q]"), ("host", "x" * 200),
    ("host", 7), ("facts.cpus", -1), ("facts.loadavg", [1, 2]), ("facts.mem_total_bytes", 1e30),
    ("queues", {"bad name!": {}}), ("queues", {"mail": {"max_slots": 10**9}}),
    ("queues", {"mail": {"lock_timeout": 5, "batch_timeout": 10}}),
    ("counters", {"mail": {"counters": {"done": -1}}}),
    ("counters", {"mail": {"counters": {"busy_s": 1e300}}}),
    ("slots", "none"), ("slots", [{"slot_no": 0}]), ("schema_version", 10**9),
    ("queues", {f"q{n}": {} for n in range(1001)}),
])
def test_out_of_range_or_wrong_report_fields_get_422(client: TestClient, path: str,
                                                     value: Any) -> None:
    assert client.post("/api/v1/reports", json=nested(good_report(), path, value),
                       headers=AUTH).status_code == 422


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_report_figures_get_422(client: TestClient, literal: str) -> None:
    """A report with busy_s NaN made every planning round fail."""
    body = good_report()
    body["counters"] = {"mail": {"counters": {"done": 1, "busy_s": "__X__"}, "alive_s": 1.0}}
    assert post_raw(client, json.dumps(body).replace('"__X__"', literal)) == 422
    assert post_raw(client, json.dumps(good_report(interval_s="__X__"))
                    .replace('"__X__"', literal)) == 422


@pytest.mark.parametrize("raw", ["", "{", "[]", "null", "7", '"x"', "[" * 100_000 + "]" * 100_000,
                                 '{"host": "a"}', "\xff\xfe"])
def test_malformed_bodies_get_4xx(client: TestClient, raw: str) -> None:
    assert 400 <= post_raw(client, raw) < 500


def test_a_body_above_1_mib_gets_413(client: TestClient) -> None:
    huge = good_report(queues={f"q{n}": {} for n in range(200_000)})
    assert post_raw(client, json.dumps(huge)) == 413
    chunks = iter([b"{" + b" " * (1 << 19)] * 4)  # no Content-Length: counted as it comes
    reply = client.post("/api/v1/reports", content=chunks, headers=AUTH)
    assert reply.status_code == 413


def test_foreign_host_headers_get_400_and_loopback_forms_pass(client: TestClient) -> None:
    for host in ("evil.example", "evil.example:7300", "127.0.0.1.nip.io"):
        assert client.get("/api/v1/cluster", headers={"Host": host}).status_code == 400
        assert client.post("/api/v1/reports", json=good_report(),
                           headers={"Host": host, **AUTH}).status_code == 400
    for host in ("127.0.0.1:7300", "localhost:7300", "[::1]:7300", "127.0.0.2"):
        assert client.get("/healthz", headers={"Host": host}).status_code == 200


def test_no_endpoint_answers_500_to_junk(redis_url: str) -> None:
    broker = open_broker(redis_url)
    service = ManagerService(ClusterState(load_settings(None)), broker, TOKEN)
    http = TestClient(create_app(service), base_url="http://127.0.0.1",
                      raise_server_exceptions=False)

    @settings(deadline=None, max_examples=50)  # sixteen requests per example
    @given(text=st.text(min_size=1, max_size=30))
    def answers_below_500(text: str) -> None:
        junk = quote(text, safe="")
        try:
            for method, path in (("GET", f"/api/v1/queues/{junk}/history"),
                                 ("POST", f"/api/v1/queues/{junk}/pause"),
                                 ("POST", f"/api/v1/queues/{junk}/resume"),
                                 ("POST", f"/api/v1/queues/{junk}/requeue-dead"),
                                 ("POST", f"/api/v1/hosts/{junk}/drain"),
                                 ("GET", f"/queues/{junk}"),
                                 ("GET", f"/?sort={junk}"),
                                 ("POST", f"/queues/{junk}/requeue")):
                for headers in ({}, AUTH):  # refused without the token, handled with it
                    reply = http.request(method, path, headers=headers)
                    assert reply.status_code < 500, (method, path, headers, reply.text[:200])
        finally:
            # A junk name may be a valid one ("0", "E"): its pause and drain are kept in the
            # session's broker, where later tests reading every control would find them.
            http.post(f"/api/v1/queues/{junk}/resume", headers=AUTH)
            http.post(f"/api/v1/hosts/{junk}/undrain", headers=AUTH)

    try:
        answers_below_500()
    finally:
        broker.close()


def test_policies_come_only_from_live_hosts(service: ManagerService,
                                            client: TestClient) -> None:
    """A forged host with max_slots=0 for a queue stopped the real host's slots and never
    expired (interval_s 1e12). Now its interval is bounded and, once it stops reporting,
    its policy no longer counts."""
    now = [1_000.0]
    service.clock = lambda: now[0]
    real = good_report("real", interval_s=2.0)
    forged = good_report("evil", interval_s=60.0)
    forged["queues"]["mail"]["max_slots"] = 0
    forged["queues"]["mail"]["min_slots"] = 0
    assert client.post("/api/v1/reports", json=real, headers=AUTH).status_code == 200
    assert client.post("/api/v1/reports", json=forged, headers=AUTH).status_code == 200
    assert service.state.policies(now[0])["mail"].max_slots == 0  # while it reports
    now[0] += 3 * 60.0 + 1  # the forged host missed 3 of its (bounded) intervals
    assert client.post("/api/v1/reports", json=real, headers=AUTH).status_code == 200
    assert service.state.policies(now[0])["mail"].max_slots == real["queues"]["mail"]["max_slots"]
    service.round()
    assert client.get("/api/v1/cluster").status_code == 200


@pytest.mark.parametrize("name", ["a%20b", "x" * 200, "%5Bq%5D", "-lead", "q%0A"])
@pytest.mark.parametrize("route", ["/api/v1/queues/{}/pause", "/api/v1/queues/{}/resume",
                                   "/api/v1/queues/{}/requeue-dead", "/api/v1/hosts/{}/drain"])
def test_control_endpoints_refuse_names_outside_the_rule(
    client: TestClient, service: ManagerService, route: str, name: str
) -> None:
    """With the token, a name no queue or host can have is a 422, not a paused or drained
    entry that lives until the manager restarts (nor a broker call)."""
    assert client.post(route.format(name), headers=AUTH).status_code == 422
    assert not service.state.paused and not service.state.drained


def test_history_of_a_name_outside_the_rule_is_422(client: TestClient) -> None:
    assert client.get("/api/v1/queues/a%20b/history").status_code == 422


def test_history_of_a_queue_nobody_knows_is_404_naming_the_closest(
    client: TestClient, service: ManagerService
) -> None:
    """A misspelt queue's history was 200 [], which reads as a queue with no rounds yet.
    A queue a master reported is known (200) even before its first round."""
    service.receive(report("host-a", {"mail": 1}))
    assert client.get("/api/v1/queues/mail/history").status_code == 200
    answer = client.get("/api/v1/queues/mial/history")
    assert answer.status_code == 404
    assert answer.json()["detail"] == ("no queue 'mial' is known to this manager "
                                       "(did you mean 'mail'?)")
    assert "did you mean" not in client.get("/api/v1/queues/zzzz/history").json()["detail"]
