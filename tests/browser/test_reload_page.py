"""The admin page's code column, reload states and buttons in a real Chromium, served by a
real manager app (uvicorn) on a real Redis: each host's code version and generation, a
failed reload's error escaped (in full on hover and when expanded, kept expanded across the
in-place refresh), the pause, drain, resume and undrain buttons setting and lifting real
controls (kept in the broker, with the token's name), the reload buttons starting a
rollout whose id the host's next reply carries, and none of them without the token."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import uvicorn
from playwright.sync_api import Page, expect

from qcluster.broker import open_broker
from qcluster.config import load_settings
from qcluster.manager.api.app import create_app
from qcluster.manager.service import ManagerService
from qcluster.manager.state import ClusterState
from qcluster.messages import CodeInfo
from tests.browser.conftest import screenshot
from tests.conftest import free_port, wait_until
from tests.unit.test_manager_state import report

pytestmark = pytest.mark.browser
TOKEN = "browser-reload-6a8c0e2b4d6f8a1c"
OPS_TOKEN = "browser-reload-ops-1b3d5f7a9c2e4a6b"
ERROR = 'ImportError: <script>window.hacked = 1</script> "app" & <b>x</b> ' + "y" * 80


@dataclass
class Served:
    url: str
    service: ManagerService
    queue: str
    hosts: tuple[str, str]

    def report(self, host: str, code: CodeInfo | None = None) -> str:
        """The host reports; returns the reload id the reply carries."""
        policies = {self.queue: report("x", {}).queues["mail"]}
        body = report(host, {self.queue: 1}, queues=policies).model_copy(
            update={"code": code or CodeInfo()})
        return self.service.receive(body).reload_id


@pytest.fixture
def served(redis_url: str, queue_name: str) -> Iterator[Served]:
    broker = open_broker(redis_url)
    started = time.time()  # a stopped clock: the reports never age, however slow the machine
    service = ManagerService(ClusterState(load_settings(None)), broker, TOKEN,
                             clock=lambda: started, tokens={"ops": OPS_TOKEN})
    suffix = queue_name[-8:]
    result = Served("", service, queue_name, (f"ha-{suffix}", f"hb-{suffix}"))
    result.report(result.hosts[0], CodeInfo(version="3f9a1c7e5b2d4a6c8e0f", generation=2))
    result.report(result.hosts[1], CodeInfo(version="3f9a1c7e5b2d4a6c8e0f", generation=1,
                                            state="failed", error=ERROR))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, message="uvicorn started")
    result.url = f"http://127.0.0.1:{port}"
    try:
        yield result
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        broker.close()


def test_each_host_shows_its_code_and_a_failed_reload_escaped(page: Page, served: Served) -> None:
    ok_host, failed_host = served.hosts
    page.goto(served.url + "/")
    ok_row = page.locator(f'tr[data-host="{ok_host}"]')
    expect(ok_row.locator(".code-version")).to_have_text("3f9a1c7e5b2d · gen 2")
    expect(ok_row.locator(".code-version")).to_have_attribute(
        "title", "version 3f9a1c7e5b2d4a6c8e0f, generation 2")
    expect(ok_row.locator(".reload-state")).to_have_text("")
    failed = page.locator(f'tr[data-host="{failed_host}"] .reload-state')
    expect(failed.locator(".tag-dead")).to_have_text("failed")
    summary = failed.locator("summary")
    expect(summary).to_have_text("failed ImportError: <script>window.hacked = 1</scrip...")
    expect(summary).to_have_attribute("title", ERROR)  # in full on hover
    assert page.evaluate("window.hacked") is None  # shown as text, never run
    assert failed.locator("script, b").count() == 0
    pre = failed.locator("pre")
    expect(pre).to_be_hidden()
    summary.click()
    expect(pre).to_have_text(ERROR)
    # The in-place refresh (every few seconds) keeps the expanded error open.
    expect(page.locator("#refresh-status")).to_contain_text("updated", timeout=30_000)
    expect(page.locator(f'tr[data-host="{failed_host}"] .reload-state pre')).to_be_visible()


def test_pause_drain_resume_undrain_buttons(page: Page, served: Served) -> None:
    host = served.hosts[0]
    page.goto(served.url + "/")
    token = page.locator("#actions input[name=token]")
    pause = page.locator(f'tr[data-queue="{served.queue}"] button[data-action="pause"]')
    token.fill("not-the-token")
    pause.click()
    expect(page.locator("h2")).to_have_text("Not authorised")
    assert served.queue not in served.service.state.paused

    page.goto(served.url + "/")
    token.fill(OPS_TOKEN)
    token.press("Enter")  # Enter in the field submits nothing
    page.wait_for_timeout(500)
    # Pauses live in the broker, which other tests share: only this queue is looked at.
    assert page.url == served.url + "/" and served.queue not in served.service.state.paused
    pause.click()
    expect(page.locator("#action-done")).to_have_text(f"Queue {served.queue} paused.")
    pause_row = page.locator(f'#controls tr[data-control="pause:{served.queue}"]')
    expect(pause_row.locator(".control-by")).to_have_text("ops")
    token.fill(TOKEN)
    page.locator(f'tr[data-host="{host}"] button[data-action="drain"]').click()
    expect(page.locator("#action-done")).to_have_text(f"Host {host} drained.")
    drain_row = page.locator(f'#controls tr[data-control="drain:{host}"]')
    expect(drain_row.locator(".control-by")).to_have_text("token")
    # Kept in the broker, which other tests share: only this test's controls are looked at.
    assert ours(served, host) == {("pause", served.queue, "ops"), ("drain", host, "token")}

    token.fill(TOKEN)
    pause_row.locator('button[data-action="resume"]').click()
    expect(page.locator("#action-done")).to_have_text(f"Queue {served.queue} resumed.")
    assert served.queue not in served.service.state.paused
    token.fill(OPS_TOKEN)
    page.locator(f'tr[data-host="{host}"] button[data-action="undrain"]').click()
    expect(page.locator("#action-done")).to_have_text(f"Host {host} undrained.")
    assert host not in served.service.state.drained
    assert ours(served, host) == set()  # gone from the broker too
    expect(page.locator(f'#controls tr[data-control="pause:{served.queue}"]')).to_have_count(0)
    expect(page.locator(f'#controls tr[data-control="drain:{host}"]')).to_have_count(0)


def ours(served: Served, host: str) -> set[tuple[str, str, str]]:
    """The controls the broker keeps for this test's queue and host: (kind, name, by)."""
    stored = served.service.control_store.read() or {}
    return {(c.kind, c.name, c.by) for c in stored.values() if c.name in (served.queue, host)}


def test_the_reload_buttons_start_a_rollout_one_host_at_a_time(page: Page,
                                                               served: Served) -> None:
    ok_host, failed_host = served.hosts
    page.goto(served.url + "/")
    token = page.locator("#actions input[name=token]")
    token.fill(OPS_TOKEN)
    page.locator('#slot-map button[data-action="reload-all"]').click()
    expect(page.locator("#action-done")).to_contain_text("Reload r")
    rollout = served.service.reload_status()
    assert rollout is not None and rollout["by"] == "ops"
    first = rollout["hosts"][0]
    assert first["host"] == ok_host and first["state"] == "asked"
    assert served.report(ok_host) == first["reload_id"]  # its next reply carries the id
    assert served.report(failed_host) == ""  # the other waits its turn
    expect(page.locator(f'#reload li[data-step="{ok_host}"] .tag')).to_have_text("asked")
    expect(page.locator(f'#reload li[data-step="{failed_host}"] .tag')).to_have_text("waiting")
    expect(page.locator('button[data-action="reload-all"]')).to_be_disabled()
    expect(page.locator(f'tr[data-host="{ok_host}"] button[data-action="reload"]')
           ).to_be_disabled()

    served.report(ok_host, CodeInfo(version="new", generation=3, state="rolling", old_slots=1,
                                    reload_id=first["reload_id"]))
    page.reload()
    expect(page.locator(f'tr[data-host="{ok_host}"] .reload-state')).to_have_text(
        "rolling 1 old slot(s)")
    served.report(ok_host, CodeInfo(version="new", generation=3,
                                    reload_id=first["reload_id"]))
    served.service.advance_reload()
    second = served.report(failed_host)
    assert second not in ("", first["reload_id"])
    served.report(failed_host, CodeInfo(state="failed", error="boom <again>",
                                        reload_id=second))
    served.service.advance_reload()
    page.reload()
    expect(page.locator("#reload-state")).to_have_text("stopped")
    expect(page.locator("#reload-note")).to_have_text(f"reload stopped: {failed_host} failed: "
                                                      "boom <again>")
    expect(page.locator(f'#reload li[data-step="{ok_host}"] .step-note')).to_have_text(
        "version 3f9a1c7e5b2d4a6c8e0f -> new, generation 3")
    expect(page.locator(".cluster-decision").first).to_contain_text("reload stopped")
    screenshot(page, "reload-stopped")  # docs/img/admin-reload.png

    # One host, with the token; a wrong token starts nothing.
    token.fill("wrong")
    page.locator(f'tr[data-host="{ok_host}"] button[data-action="reload"]').click()
    expect(page.locator("h2")).to_have_text("Not authorised")
    page.goto(served.url + "/")
    token.fill(TOKEN)
    page.locator(f'tr[data-host="{ok_host}"] button[data-action="reload"]').click()
    expect(page.locator("#action-done")).to_contain_text("Reload r")
    last = served.service.reload_status()
    assert last is not None and last["by"] == "token"
    assert [h["host"] for h in last["hosts"]] == [ok_host]
