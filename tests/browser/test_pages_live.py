"""The admin pages in a real Chromium, served by a real ``qcluster manager`` fed by two real
``qcluster master`` processes (hosts a and b) over the real Redis.

Each host is capped at 2 slots (``[master] max_slots``) while the queue may use 8, so a
flood keeps the queue short of capacity: its row stays red (the manager wants to resize)
long enough for a person, or a test, to see it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page

from qcluster.broker import open_broker
from qcluster.broker.base import Broker
from qcluster.client import Client
from tests.browser.conftest import screenshot
from tests.conftest import QCLUSTER, ROOT, free_port, qcluster_env, wait_until

pytestmark = pytest.mark.browser
TOKEN = "live-admin-token"
HOSTS = ("a", "b")


@dataclass
class Cluster:
    url: str
    queue: str
    broker_url: str
    broker: Broker
    workdir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def cluster(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "/api/v1/cluster", timeout=30) as response:
            return dict(json.loads(response.read()))

    def logs(self) -> str:
        return "\n".join(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}"
                         for path in sorted(self.workdir.glob("*.log")))


def _start(cluster: Cluster, name: str, *args: str) -> None:
    log = (cluster.workdir / f"{name}.log").open("ab")
    cluster.procs[name] = subprocess.Popen(
        [*QCLUSTER, *args], cwd=ROOT, env=qcluster_env(QC_ADMIN_QUEUE=cluster.queue),
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )


def _stop(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    """SIGTERM every process group (masters take their slots down), then SIGKILL leftovers."""
    for proc in procs.values():
        if proc.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs.values():
        # Nothing is checked here: a master whose slots sleep in a handler is not waited
        # for past 5 s (its stop grace time cost a job-browser test 20 s of teardown).
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture
def cluster(redis_url: str, queue_name: str, tmp_path: Path) -> Iterator[Cluster]:
    config = tmp_path / "qcluster.toml"
    config.write_text(
        f'token = "{TOKEN}"\n'
        f'state_dir = "{tmp_path / "state"}"\n'
        "[master]\nmax_slots = 2\nreport_interval_s = 0.5\n"
        "[manager]\ninterval_s = 0.5\n"
    )
    port = free_port()
    running = Cluster(f"http://127.0.0.1:{port}", queue_name, redis_url, open_broker(redis_url),
                      tmp_path)
    common = ("--config", str(config), "--broker", redis_url)
    try:
        _start(running, "manager", "manager", *common, "--listen", f"127.0.0.1:{port}")
        for host in HOSTS:
            _start(running, f"master-{host}", "master", *common, "--manager", running.url,
                   "--host-name", host, "--app", "tests.browser.live_app",
                   "--listen", f"127.0.0.1:{free_port()}", "--no-metrics")
        yield running
    finally:
        _stop(running.procs)
        running.broker.purge(queue_name)
        running.broker.close()


def _hosts_reported(cluster: Cluster) -> bool:
    try:
        view = cluster.cluster()
    except OSError:
        return False
    hosts = {h["name"] for h in view["hosts"] if h["alive"]}
    return hosts == set(HOSTS)


def test_real_manager_and_masters(page: Page, cluster: Cluster) -> None:
    queue = cluster.queue
    wait_until(lambda: _hosts_reported(cluster), timeout_s=60,
               message=f"both masters reported\n{cluster.logs()}")

    # Dead-letter a few jobs first, through real slots.
    with Client(cluster.broker_url) as producer:
        producer.enqueue_many(queue, [{"bad": n} for n in (1, 2, 3)])
    wait_until(lambda: cluster.broker.stats(queue).dead == 3, timeout_s=60,
               message=f"3 dead jobs\n{cluster.logs()}")

    # The queue table and the slot map: both hosts, the queue with its policy.
    page.goto(cluster.url + "/")
    row = page.locator(f'tr[data-queue="{queue}"]')
    assert "1 / 8" in row.inner_text()  # min / max from the app's policy
    for host in HOSTS:
        host_row = page.locator(f'tr[data-host="{host}"]')
        assert host_row.count() == 1
        assert "DEAD" not in host_row.inner_text()
    wait_until(lambda: row.locator("td.dead").inner_text() == "3", timeout_s=60,
               message="dead count on the page after refresh")

    # Flood: the manager wants more slots than the two hosts can give -> red row, decision.
    # 20,000 jobs (~100 s for 4 slots): the plan stays at 4 for long enough to see both hosts
    # run 2 slots even when they start slowly (with 4,000 it went back to 2 within 5 s).
    with Client(cluster.broker_url) as producer:
        producer.enqueue_many(queue, [{"n": n} for n in range(20_000)])
    wait_until(lambda: "resizing" in (row.get_attribute("class") or ""), timeout_s=60,
               message=f"red (resizing) row after the flood\n{cluster.logs()}")
    color = row.locator("td").first.evaluate("cell => getComputedStyle(cell).backgroundColor")
    assert color == "rgb(253, 236, 234)"
    decisions = page.locator("#decisions")
    wait_until(lambda: queue in decisions.inner_text() and "→ 4" in decisions.inner_text(),
               timeout_s=60, message=f"a decision to 4 slots\n{decisions.inner_text()}")
    wait_until(lambda: all(page.locator(f'tr[data-host="{h}"]').inner_text().count("2 / 2")
                           for h in HOSTS),
               timeout_s=60, message="2 planned / 2 running on each host")
    screenshot(page, "live-overview-flooded")
    cluster.broker.purge(queue)  # the flood's rest (dead jobs are kept): requeue comes next

    # Queue detail: real dead jobs; requeue refused without / with a wrong token.
    page.goto(f"{cluster.url}/queues/{queue}")
    assert page.locator("svg.chart").count() == 4
    assert "bad payload #" in page.locator("table.dead-jobs").inner_text()
    assert page.locator("#dead-count").inner_text() == "3"
    refused = page.request.post(f"{cluster.url}/queues/{queue}/requeue", form={})
    assert refused.status == 401
    page.fill('input[name="token"]', "wrong")
    page.click("form.requeue button")
    assert "Not authorised" in page.locator("h2").inner_text()
    assert cluster.broker.stats(queue).dead == 3

    page.goto(f"{cluster.url}/queues/{queue}")
    page.fill('input[name="token"]', TOKEN)
    page.click("form.requeue button")
    assert "Requeued 3 dead job" in page.locator("#requeued").inner_text()
    # The requeued jobs run again in real slots and are dead-lettered again.
    wait_until(lambda: page.locator("#dead-count").inner_text() == "3", timeout_s=60,
               message="the requeued jobs dead again, shown by the refreshing page")
    screenshot(page, "live-queue-requeued")

