"""The admin page in a real Chromium against a real manager fed by two real masters."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from qcluster.broker import open_broker
from qcluster.client import Client
from tests.browser.conftest import screenshot
from tests.conftest import wait_until
from tests.e2e.cluster import Procs
from tests.e2e.test_manager import Cluster, write_config

pytestmark = pytest.mark.browser


@pytest.fixture
def cluster(tmp_path: Path, redis_url: str) -> Iterator[Cluster]:
    prefix = f"ui{uuid.uuid4().hex[:8]}"
    logs = tmp_path / "executed"
    logs.mkdir()
    procs = Procs(tmp_path, {"QC_TEST_PREFIX": prefix, "QC_TEST_LOG_DIR": str(logs),
                             "QCLUSTER_TOKEN": "t0ken",
                             "QCLUSTER_METRICS_DIR": str(tmp_path / "metrics")})
    running = Cluster(procs, redis_url, prefix, write_config(tmp_path / "q.toml", prefix, 8))
    try:
        running.start_manager()
        running.start_master("a")
        running.start_master("b")
        wait_until(lambda: len([h for h in running.view()["hosts"] if h["alive"]]) == 2,
                   timeout_s=20, message="both masters reporting")
        yield running
    finally:
        procs.stop_all()
        with Client(redis_url) as client:
            client.purge(running.q("work"))


def test_live_cluster_page(page, cluster: Cluster) -> None:  # type: ignore[no-untyped-def]
    url = f"http://127.0.0.1:{cluster.port}"
    work = cluster.q("work")
    page.goto(url + "/")
    wait_until(lambda: page.locator("tr.host-row").count() == 2, timeout_s=10,
               message="both hosts in the slot map")
    assert page.locator(f'tr[data-queue="{work}"]').count() == 1
    decisions_before = page.locator("ol.decisions li").count()
    with Client(cluster.broker_url) as client:
        client.enqueue_many(work, [{"n": n} for n in range(40_000)])
        row = page.locator(f'tr[data-queue="{work}"]')
        # The page refreshes itself: no reload here.
        wait_until(lambda: "resizing" in (row.get_attribute("class") or ""), timeout_s=15,
                   message="the flooded queue's row turns red")
        wait_until(lambda: page.locator("#decisions").inner_text().count(work) >= 1
                   and page.locator("ol.decisions li").count() > decisions_before,
                   timeout_s=15, message="a decision about the queue appears")
        screenshot(page, "live-overview-resizing")
        client.purge(work)

    broker = open_broker(cluster.broker_url)
    try:
        with Client(cluster.broker_url) as client:
            client.enqueue(work, {"n": -1})
        # Take it before a slot does (work's slots may be running): retry until we own one.
        wait_until(lambda: _dead_letter_one(broker, work), timeout_s=10, message="dead job")
        page.goto(f"{url}/queues/{work}")
        assert "broken on purpose" in page.locator("table.dead-jobs").inner_text()
        page.fill('input[name="token"]', "wrong")
        page.click("form.requeue button")
        assert "Not authorised" in page.locator("h2").inner_text()
        assert broker.stats(work).dead == 1
        page.goto(f"{url}/queues/{work}")
        page.fill('input[name="token"]', "t0ken")
        page.click("form.requeue button")
        assert "Requeued 1 dead job" in page.locator("#requeued").inner_text()
        assert broker.stats(work).dead == 0
        screenshot(page, "live-queue-detail")
    finally:
        broker.close()


def _dead_letter_one(broker, queue: str) -> bool:  # type: ignore[no-untyped-def]
    taken = broker.take(queue, max_jobs=1, lock_timeout_s=30)
    if not taken:
        return broker.stats(queue).dead > 0
    broker.dead(queue, taken[0], "broken on purpose")
    return True
