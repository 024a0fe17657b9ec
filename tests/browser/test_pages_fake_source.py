"""The admin pages in a real Chromium, served by uvicorn from a fixed cluster picture whose
dead-letter jobs live in the real Redis. Fast and deterministic; test_pages_live.py does the
same against a real manager fed by real masters."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI
from playwright.sync_api import Browser, Page

from qcluster.admin_ui.router import install
from qcluster.broker import open_broker
from qcluster.client import Client
from tests.browser.fake_source import FakeSource
from tests.conftest import free_port, wait_until

pytestmark = pytest.mark.browser
Served = tuple[str, FakeSource]


@pytest.fixture
def served(redis_url: str, queue_name: str) -> Iterator[tuple[str, FakeSource]]:
    broker = open_broker(redis_url)
    source = FakeSource(broker, queue_name)
    app = FastAPI()
    install(app, source)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, message="uvicorn started")
    try:
        yield f"http://127.0.0.1:{port}", source
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        broker.purge(queue_name)
        broker.close()


def test_queue_table_slot_map_and_decisions(page: Page, served: Served) -> None:
    url, _ = served
    page.goto(url + "/")
    mail = page.locator('tr[data-queue="mail"]')
    assert "12,000" in mail.inner_text() and "240%" in mail.inner_text()
    assert "resizing" in (mail.get_attribute("class") or "")
    red = mail.locator("td").first.evaluate("cell => getComputedStyle(cell).backgroundColor")
    assert red == "rgb(253, 236, 234)"
    assert page.locator('tr[data-host="host-a"]').count() == 1
    dead_host = page.locator('tr[data-host="host-b"]')
    assert "DEAD" in dead_host.inner_text()
    assert "dead-host" in (dead_host.get_attribute("class") or "")
    assert "load 240% > 130%" in page.locator("#decisions").inner_text()


def test_sort_survives_the_refresh_and_scroll_is_kept(page: Page, served: Served) -> None:
    url, source = served
    page.set_viewport_size({"width": 1000, "height": 300})
    page.goto(url + "/")
    page.click('a[data-sort="backlog"]')  # first click: descending
    page.click('a[data-sort="backlog"]')  # second: ascending
    assert "dir=asc" in page.url

    def order() -> list[str]:
        return page.locator("tr.queue-row").evaluate_all("rows => rows.map(r => r.dataset.queue)")

    assert order()[-1] == "mail"
    page.mouse.wheel(0, 250)
    wait_until(lambda: page.evaluate("window.scrollY") > 0, message="scrolled")
    scrolled = page.evaluate("window.scrollY")
    source.queues[1] = source.queues[1].model_copy(update={"backlog": 99_999})
    wait_until(lambda: "99,999" in page.locator('tr[data-queue="resize"]').inner_text(),
               timeout_s=60, message="in-place refresh")
    assert order()[-1] == "resize"  # still sorted by backlog ascending, with the new numbers
    assert page.evaluate("window.scrollY") == scrolled


def test_queue_detail_charts_and_requeue_with_token(
    page: Page, served: Served, redis_url: str, queue_name: str
) -> None:
    url, source = served
    with Client(redis_url) as producer:
        producer.enqueue(queue_name, {"to": "nobody"})
    delivery = source.broker.take(queue_name, max_jobs=1, lock_timeout_s=30)[0]
    source.broker.dead(queue_name, delivery, "invalid address 'nobody'")
    page.goto(f"{url}/queues/{queue_name}")
    assert page.locator("svg.chart").count() == 4
    assert "invalid address" in page.locator("table.dead-jobs").inner_text()

    page.fill('input[name="token"]', "wrong")
    page.click("form.requeue button")
    assert "Not authorised" in page.locator("h2").inner_text()
    assert source.broker.stats(queue_name).dead == 1

    page.goto(f"{url}/queues/{queue_name}")
    page.fill('input[name="token"]', "s3cret")
    page.click("form.requeue button")
    assert "Requeued 1 dead job" in page.locator("#requeued").inner_text()
    assert source.broker.stats(queue_name).ready == 1


def queue_order(page: Page) -> list[str]:
    rows = page.query_selector_all("tr.queue-row")
    return [row.get_attribute("data-queue") or "" for row in rows]


def test_pages_work_without_javascript(browser: Browser, served: Served) -> None:
    url, _ = served
    context = browser.new_context(java_script_enabled=False)
    page = context.new_page()
    page.goto(url + "/?sort=name&dir=asc")
    rows = queue_order(page)
    assert rows == sorted(rows)  # sorted by the server: no script needed
    page.click('a[data-sort="name"]')  # the header link flips the direction, server-side
    rows = queue_order(page)
    assert rows == sorted(rows, reverse=True)
    context.close()
