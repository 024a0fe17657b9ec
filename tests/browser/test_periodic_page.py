"""The admin overview lists the periodic jobs with their last and next run, in a real
Chromium, served by a real manager app (uvicorn) whose ticker enqueues on a real Redis: a
job every second shows a last run once its first tick is enqueued (refreshed in place),
a yearly one shows "never"."""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import uvicorn
from playwright.sync_api import Page, expect

from qcluster.broker import open_broker
from qcluster.config import load_settings
from qcluster.manager.api.app import create_app
from qcluster.manager.service import ManagerService
from qcluster.manager.state import ClusterState
from tests.conftest import free_port, wait_until

pytestmark = pytest.mark.browser
TOKEN = "browser-periodic-7d3b9e1a5c2f4a6e"


@dataclass
class Served:
    url: str
    service: ManagerService
    every_second: str
    yearly: str
    queue: str


@pytest.fixture
def served(redis_url: str, queue_name: str, tmp_path: Path) -> Iterator[Served]:
    every_second, yearly = f"beat-{uuid.uuid4().hex[:8]}", f"yearly-{uuid.uuid4().hex[:8]}"
    config = tmp_path / "qcluster.toml"
    config.write_text(f'[periodic.{every_second}]\nqueue = "{queue_name}"\nevery = 1\n\n'
                      f'[periodic.{yearly}]\nqueue = "{queue_name}"\ncron = "0 0 1 1 *"\n'
                      'catch_up = "latest"\n')
    broker = open_broker(redis_url)
    service = ManagerService(ClusterState(load_settings(config)), broker, TOKEN)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, message="uvicorn started")
    try:
        yield Served(f"http://127.0.0.1:{port}", service, every_second, yearly, queue_name)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        broker.purge(queue_name)
        broker.close()


def test_the_overview_lists_periodic_jobs_with_last_and_next_run(page: Page,
                                                                 served: Served) -> None:
    page.goto(served.url + "/")
    beat = page.locator(f'#periodic tr[data-periodic="{served.every_second}"]')
    expect(beat).to_contain_text(served.queue)
    expect(beat).to_contain_text("every 1 s")
    expect(beat.locator(".periodic-next")).to_contain_text(re.compile(r"UTC \(in \d+s\)"))
    # The ticker enqueues a tick a second; the in-place refresh shows it without a reload.
    expect(beat.locator(".periodic-last")).to_contain_text(
        re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC \(\d+s ago\)"), timeout=60_000)
    wait_until(lambda: served.service.broker.stats(served.queue).ready > 0,
               message="the ticks are in the queue")

    yearly = page.locator(f'#periodic tr[data-periodic="{served.yearly}"]')
    expect(yearly.locator(".periodic-last")).to_have_text("never")
    next_year = time.gmtime().tm_year + 1
    expect(yearly.locator(".periodic-next")).to_contain_text(f"{next_year}-01-01 00:00:00 UTC")
    expect(yearly).to_contain_text("latest")
    expect(page.locator("#periodic a", has_text=served.queue).first).to_have_attribute(
        "href", f"/queues/{served.queue}")
