"""The admin page shows the controls in force with who (the token's name, never its value)
and when, in a real Chromium, served by a real manager app (uvicorn) on a real Redis: a
paused queue, a drained host, and both gone from the page (refreshed in place) once lifted."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import uvicorn
from playwright.sync_api import Page, expect

from qcluster.broker import open_broker
from qcluster.config import load_settings
from qcluster.manager.api.app import create_app
from qcluster.manager.service import ManagerService
from qcluster.manager.state import ClusterState
from tests.conftest import free_port, wait_until
from tests.unit.test_manager_state import report

pytestmark = pytest.mark.browser
TOKEN = "browser-controls-5e7a9c1b3d4f6a8b"
OPS_TOKEN = "browser-controls-ops-2c4e6a8b0d1f3a5c"


@dataclass
class Served:
    url: str
    service: ManagerService
    queue: str
    host: str


@pytest.fixture
def served(redis_url: str, queue_name: str) -> Iterator[Served]:
    broker = open_broker(redis_url)
    started = time.time()  # a stopped clock: the reports never age, however slow the machine
    service = ManagerService(ClusterState(load_settings(None)), broker, TOKEN,
                             clock=lambda: started, tokens={"ops": OPS_TOKEN})
    host = f"h-{queue_name[-8:]}"
    policies = {queue_name: report("x", {}).queues["mail"]}
    service.receive(report(host, {queue_name: 1}, queues=policies))
    service.receive(report(f"{host}-2", {queue_name: 1}, queues=policies))  # stays live
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, message="uvicorn started")
    try:
        yield Served(f"http://127.0.0.1:{port}", service, queue_name, host)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        broker.close()


def post(served: Served, path: str, token: str) -> httpx.Response:
    response = httpx.post(served.url + path, headers={"Authorization": f"Bearer {token}"},
                          timeout=30)
    assert response.status_code == 200, response.text
    return response


def test_the_page_shows_who_paused_and_drained_and_when(page: Page, served: Served) -> None:
    before = served.service.clock()
    paused = post(served, f"/api/v1/queues/{served.queue}/pause", OPS_TOKEN).json()
    post(served, f"/api/v1/hosts/{served.host}/drain", TOKEN)
    assert paused["by"] == "ops" and paused["at"] == before
    served.service.round()  # the round re-reads the controls from the broker
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(paused["at"]))

    page.goto(served.url + "/")
    pause_row = page.locator(f'#controls tr[data-control="pause:{served.queue}"]')
    expect(pause_row.locator(".control-by")).to_have_text("ops")
    expect(pause_row.locator(".control-at")).to_contain_text(since)
    expect(pause_row.locator(".control-at")).to_contain_text(re.compile(r"\d+s ago"))
    drain_row = page.locator(f'#controls tr[data-control="drain:{served.host}"]')
    expect(drain_row.locator(".control-by")).to_have_text("token")
    tag = page.locator(f'tr[data-queue="{served.queue}"] .tag-paused')
    expect(tag).to_have_attribute("title", f"paused by ops at {since}")
    drained = page.locator(f'tr[data-host="{served.host}"]')
    expect(drained.locator(".tag-drained")).to_have_attribute(
        "title", re.compile(r"^drained by token at \d{4}-\d\d-\d\d "))
    expect(drained.locator(".tag-dead")).to_have_count(0)  # drained, not dead
    assert OPS_TOKEN not in page.content() and TOKEN not in page.content()

    page.goto(served.url + f"/queues/{served.queue}")
    expect(page.locator("#paused .control-by")).to_have_text("ops")
    expect(page.locator("#paused .control-at")).to_have_text(since)

    page.goto(served.url + "/")
    post(served, f"/api/v1/queues/{served.queue}/resume", TOKEN)
    post(served, f"/api/v1/hosts/{served.host}/undrain", OPS_TOKEN)
    # The in-place refresh (every few seconds) drops both without a reload.
    expect(pause_row).to_have_count(0, timeout=60_000)
    expect(drain_row).to_have_count(0, timeout=60_000)
    expect(tag).to_have_count(0)
