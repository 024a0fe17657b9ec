"""The admin page's buttons without a browser (FastAPI TestClient, the manager's service on a
real Redis): each refusal has its page and status, a crafted notice link puts no words on
the page, the token may come as a Bearer header, and a source without actions (a test's
fake) shows no button and has no button route."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from qcluster.broker import open_broker
from qcluster.config import load_settings
from qcluster.manager.api.app import create_app
from qcluster.manager.service import ManagerService
from qcluster.manager.state import ClusterState
from tests.browser.fake_source import FakeSource
from tests.unit.test_manager_state import report

TOKEN = "unit-reload-page-5d7f9b1c3e5a7c9e"


@pytest.fixture
def manager(redis_url: str) -> Iterator[tuple[ManagerService, TestClient]]:
    broker = open_broker(redis_url)
    service = ManagerService(ClusterState(load_settings(None)), broker, TOKEN,
                             tokens={"ops": "unit-reload-page-ops-2a4c6e8b0d2f"})
    yield service, TestClient(create_app(service), base_url="http://127.0.0.1",
                              follow_redirects=False)
    broker.close()


def test_refusals_have_their_page_and_status(manager: tuple[ManagerService, TestClient]
                                             ) -> None:
    service, client = manager
    service.receive(report("h1", {"mail": 1}))
    assert client.post("/reload", data={"token": "wrong"}).status_code == 401
    assert client.post("/hosts/h1/reload").status_code == 401  # no token at all
    unknown = client.post("/hosts/nobody/reload", data={"token": TOKEN})
    assert unknown.status_code == 404 and "no host named nobody" in unknown.text
    bad = client.post("/hosts/%3Cb%3E/reload", data={"token": TOKEN})
    assert bad.status_code == 404 and "<b>" not in bad.text and "&lt;b&gt;" in bad.text
    done = client.post("/hosts/h1/reload", data={"token": TOKEN})
    assert done.status_code == 303 and done.headers["location"].startswith("/?done=reload&")
    busy = client.post("/reload", data={"token": TOKEN})
    assert busy.status_code == 409 and "is running" in busy.text
    rollout = service.reload_status()
    assert rollout is not None and rollout["by"] == "token"


def test_the_token_may_be_a_bearer_header_and_the_notice_is_fixed_text(
        manager: tuple[ManagerService, TestClient], queue_name: str) -> None:
    service, client = manager
    service.pause(queue_name)
    moved = client.post(f"/queues/{queue_name}/resume",
                        headers={"Authorization": f"Bearer {TOKEN}"})
    assert moved.status_code == 303 and queue_name not in service.state.paused
    page = client.get(moved.headers["location"]).text
    assert f"Queue {queue_name} resumed." in page
    crafted = client.get("/?done=resume&name=call%20+1-555%20now").text
    assert "1-555" not in crafted and 'id="action-done"' not in crafted
    assert 'id="action-done"' not in client.get("/?done=anything&name=x").text


def test_a_source_without_actions_shows_no_button(redis_url: str, queue_name: str) -> None:
    from fastapi import FastAPI

    from qcluster.admin_ui.router import install

    broker = open_broker(redis_url)
    try:
        app = FastAPI()
        install(app, FakeSource(broker, queue_name))
        client = TestClient(app, base_url="http://127.0.0.1")
        page = client.get("/").text
        assert 'id="actions"' not in page and "formaction" not in page
        assert client.post("/reload", data={"token": "s3cret"}).status_code in (404, 405)
    finally:
        broker.close()
