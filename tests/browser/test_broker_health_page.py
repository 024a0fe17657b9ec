"""The admin overview's Broker table (issue 17 item 5), in a real Chromium, served by a real
manager app (uvicorn, its planning loop running) on a real private Redis Cluster of three
masters with one replica each: every node with its role and hash slots, the queues each
master serves, a queue's page naming its node; a SIGKILLed master turns DOWN in place at
the next rounds, without a reload."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import uvicorn
from playwright.sync_api import Page, expect

from qcluster.broker import open_broker
from qcluster.manager.api.app import create_app
from qcluster.manager.service import ManagerService
from tests.brokers import BrokerUnavailable, PrivateRedisCluster
from tests.conftest import free_port, wait_until
from tests.unit.test_manager_state import make_policy, report, state

pytestmark = pytest.mark.browser
QUEUES = ["alpha", "beta", "gamma"]


@dataclass
class Served:
    url: str
    service: ManagerService
    cluster: PrivateRedisCluster


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    cluster = PrivateRedisCluster(tmp_path / "cluster",
                                 node_timeout_ms=5000)  # no spurious failover under load
    try:
        cluster.start()
    except BrokerUnavailable as error:
        pytest.fail(str(error), pytrace=False)
    broker = open_broker(cluster.url)
    service = ManagerService(state(), broker, "browser-broker-5e1f")
    reporting = threading.Event()

    def keep_reporting() -> None:  # a live host: its queues stay declared
        while not reporting.wait(0.5):
            service.receive(report("h1", {}, queues={q: make_policy() for q in QUEUES}))

    service.receive(report("h1", {}, queues={q: make_policy() for q in QUEUES}))
    reporter = threading.Thread(target=keep_reporting, daemon=True)
    reporter.start()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, message="uvicorn started")
    try:
        yield Served(f"http://127.0.0.1:{port}", service, cluster)
    finally:
        reporting.set()
        reporter.join(timeout=10)
        server.should_exit = True
        thread.join(timeout=30)
        broker.close()
        cluster.stop()


def test_the_broker_table_shows_each_node_and_a_killed_master_turns_down(
        page: Page, served: Served) -> None:
    page.goto(served.url + "/")
    rows = page.locator("#broker tr.broker-node")
    expect(rows).to_have_count(6)
    expect(page.locator('#broker tr[data-role="master"]')).to_have_count(3)
    expect(page.locator('#broker tr[data-role="replica"]')).to_have_count(3)
    expect(page.locator("#broker h2")).to_contain_text("6 of 6 nodes answer")

    alpha_port = served.cluster.master_of("qc:{alpha}:ready").port
    alpha_row = page.locator(f'#broker tr[data-node="127.0.0.1:{alpha_port}"]')
    expect(alpha_row.locator(".node-queues")).to_contain_text("alpha")
    expect(alpha_row.locator(".node-state")).to_have_text("ok")

    page.goto(served.url + "/queues/alpha")
    expect(page.locator("#broker-node")).to_contain_text(f"127.0.0.1:{alpha_port}")

    page.goto(served.url + "/")
    served.cluster.master_of("qc:{alpha}:ready").kill()
    # The loop's stats read of alpha fails: the round reads the nodes again; the page's
    # in-place refresh shows it.
    expect(alpha_row.locator(".node-state")).to_contain_text("DOWN", timeout=60_000)
    expect(page.locator("#broker h2")).to_contain_text("of 6 nodes answer")
