"""The admin page's job browser in a real Chromium, served by a real ``qcluster manager`` with
a real ``qcluster master`` on the private Redis: a job found by id from the search box, the
jobs running now in real slots, a dead letter's payload and traceback, per-job requeue and
delete refused without the token, and 100,000 dead letters a page at a time."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from playwright.sync_api import Page

from qcluster.broker import Settlement, open_broker
from qcluster.broker.base import Broker
from qcluster.client import Client
from qcluster.failures import JobError
from tests.browser.conftest import screenshot
from tests.browser.test_pages_live import Cluster, _start, _stop
from tests.conftest import free_port, wait_until
from tests.contract.test_job_lookup import body, take

pytestmark = pytest.mark.browser
TOKEN = "job-browser-token-7e2a91"
TRACEBACK = ('Traceback (most recent call last):\n  File "app.py", line 9, in send\n'
             "    smtp.send(job.payload)\nsmtplib.SMTPServerDisconnected: gone\n")
#: Dead letters written per pipelined command when filling a queue with them.
FILL_CHUNK = 5_000


@pytest.fixture
def cluster(redis_url: str, queue_name: str, tmp_path: Path) -> Iterator[Cluster]:
    config = tmp_path / "qcluster.toml"
    config.write_text(f'token = "{TOKEN}"\nstate_dir = "{tmp_path / "state"}"\n'
                      "[master]\nreport_interval_s = 0.5\n[manager]\ninterval_s = 0.5\n")
    port = free_port()
    running = Cluster(f"http://127.0.0.1:{port}", queue_name, redis_url, open_broker(redis_url),
                      tmp_path)
    common = ("--config", str(config), "--broker", redis_url)
    try:
        _start(running, "manager", "manager", *common, "--listen", f"127.0.0.1:{port}")
        _start(running, "master", "master", *common, "--manager", running.url,
               "--host-name", "host-j", "--app", "tests.browser.jobs_app",
               "--listen", f"127.0.0.1:{free_port()}", "--no-metrics")
        yield running
    finally:
        _stop(running.procs)
        running.broker.purge(queue_name)
        running.broker.close()


def fill_dead(client: redis.Redis, keys: list[str], count: int, prefix: str) -> None:
    """``count`` dead letters (bulk-1 oldest to bulk-COUNT newest) in a few pipelined
    commands of FILL_CHUNK each: seconds, and never a long script holding the server."""
    dead, jobs, reasons, attempts = keys
    now_ms = int(time.time() * 1000)
    for start in range(1, count + 1, FILL_CHUNK):
        ids = [f"bulk-{n}" for n in range(start, min(count, start + FILL_CHUNK - 1) + 1)]
        pipe = client.pipeline(transaction=False)
        pipe.zadd(dead, {job_id: now_ms - count + n for n, job_id in enumerate(ids, start)})
        pipe.hset(jobs, mapping={i: f"{prefix}{i.removeprefix('bulk-')}}}}}" for i in ids})
        pipe.hset(reasons, mapping=dict.fromkeys(ids, "attempt 3 of 3 raised"))
        pipe.hset(attempts, mapping=dict.fromkeys(ids, 3))
        pipe.execute()
    assert client.zcard(dead) == count


def _reported(cluster: Cluster) -> bool:
    try:
        return any(h["name"] == "host-j" for h in cluster.cluster()["hosts"])
    except OSError:
        return False


def dead_letter(broker: Broker, queue: str, job_id: str, payload: object) -> None:
    """Dead-letter a job with its last error, as a slot does when a handler raised."""
    broker.publish(queue, job_id, body(queue, job_id, payload))
    taken = take(broker, queue)
    error = JobError.bounded(type="smtplib.SMTPServerDisconnected", message="gone",
                             traceback=TRACEBACK, host="host-j", slot="1", attempt=3,
                             at=time.time())
    broker.settle(queue, Settlement(dead=[(taken[0], "attempt 3 of 3 raised")],
                                    errors={taken[0].id: error}))


def test_running_jobs_search_traceback_and_per_job_actions(page: Page,
                                                           cluster: Cluster) -> None:
    dead_queue = f"{cluster.queue}-dead"
    broker = cluster.broker
    wait_until(lambda: _reported(cluster), timeout_s=60,
               message=f"the master reported to the manager\n{cluster.logs()}")
    try:
        dead_letter(broker, dead_queue, "mail-41", {"to": "ann@example.com", "n": 41})
        dead_letter(broker, dead_queue, "mail-42", {"to": "bob@example.com", "n": 42})
        with Client(cluster.broker_url) as producer:
            ids = [producer.enqueue(cluster.queue, {"sleep": n}) for n in range(3)]
        wait_until(lambda: broker.stats(cluster.queue).locked == 2, timeout_s=60,
                   message=f"two jobs running in the master's slots\n{cluster.logs()}")

        # Running now: the slots' jobs, with their attempt; the search box finds one.
        page.goto(f"{cluster.url}/queues/{cluster.queue}/jobs?state=running")
        rows = page.locator("tr.job-row")
        assert rows.count() == 2 and page.locator("#page-span").inner_text() == "1 to 2 of 2"
        running = rows.evaluate_all("rows => rows.map(r => r.dataset.job)")
        assert set(running) < set(ids)
        # Where each runs, from the master's report of its slots' takes (a slot's take is
        # in its master's next report), and for how long.
        def placed() -> bool:
            page.goto(f"{cluster.url}/queues/{cluster.queue}/jobs?state=running")
            return rows.locator("td.job-host").all_inner_texts() == ["host-j", "host-j"]

        wait_until(placed, timeout_s=60, interval_s=0.5,
                   message="both running jobs shown on host-j")
        slots = rows.locator("td.job-slot").all_inner_texts()
        assert all(slot.isdigit() for slot in slots), slots
        assert "—" not in rows.locator("td.job-for").all_inner_texts()
        page.fill('header input[name="id"]', running[0])
        page.click("header form.job-search button")
        assert page.locator("#job-state").inner_text() == "running"
        waiting = next(i for i in ids if i not in running)
        page.fill('header input[name="id"]', waiting)
        page.click("header form.job-search button")
        assert page.locator("#job-state").inner_text() == "ready"
        page.fill('header input[name="id"]', "no-such-job")
        page.click("header form.job-search button")
        assert page.locator("#job-unknown").is_visible()

        # A dead letter: payload as JSON (not the envelope), reason, traceback.
        page.goto(f"{cluster.url}/queues/{dead_queue}/jobs?state=dead")
        row = page.locator('tr[data-job="mail-41"]')
        assert "attempt 3 of 3 raised" in row.locator(".job-reason").inner_text()
        row.locator(".job-error summary").click()
        assert "SMTPServerDisconnected: gone" in row.locator("pre.traceback").inner_text()
        row.locator(".job-payload summary").click()
        assert '"to": "ann@example.com"' in row.locator("pre.payload-json").inner_text()
        assert "enqueued_at" not in row.inner_text()
        screenshot(page, "job-browser-dead")

        # Per-job delete and requeue: refused without the token, done with it.
        row.locator('button[data-action="delete"]').click()
        assert "Not authorised" in page.locator("h2").inner_text()
        assert broker.stats(dead_queue).dead == 2
        page.goto(f"{cluster.url}/queues/{dead_queue}/jobs?state=dead")
        page.fill('#job-actions input[name="token"]', TOKEN)
        page.locator('tr[data-job="mail-41"] button[data-action="delete"]').click()
        assert "Deleted 1 dead job" in page.locator("#jobs-done").inner_text()
        assert page.locator('tr[data-job="mail-41"]').count() == 0
        page.fill('#job-actions input[name="token"]', TOKEN)
        page.locator('tr[data-job="mail-42"] button[data-action="requeue"]').click()
        assert "Requeued 1 dead job" in page.locator("#jobs-done").inner_text()
        assert broker.stats(dead_queue).dead == 0 and broker.stats(dead_queue).ready == 1
        page.fill('header input[name="id"]', "mail-42")
        page.click("header form.job-search button")
        assert page.locator("#job-state").inner_text() == "ready"

        # Ticked rows, deleted together.
        broker.purge(dead_queue)  # the requeued job, or the next take would get it
        for n in (43, 44, 45):
            dead_letter(broker, dead_queue, f"mail-{n}", {"n": n})
        page.goto(f"{cluster.url}/queues/{dead_queue}/jobs?state=dead")
        page.check('tr[data-job="mail-43"] input[type="checkbox"]')
        page.check('tr[data-job="mail-45"] input[type="checkbox"]')
        page.fill('#job-actions input[name="token"]', TOKEN)
        page.click('button[data-action="delete-selected"]')
        assert "Deleted 2 dead job" in page.locator("#jobs-done").inner_text()
        left = page.locator("tr.job-row").evaluate_all("rows => rows.map(r => r.dataset.job)")
        assert left == ["mail-44"]
    finally:
        broker.purge(dead_queue)


def test_a_hundred_thousand_dead_letters_a_page_at_a_time(page: Page, cluster: Cluster,
                                                          redis_url: str) -> None:
    queue = f"{cluster.queue}-bulk"
    keys = [f"qc:{{{queue}}}:{name}" for name in ("dead", "jobs", "reasons", "attempts")]
    wait_until(lambda: _reported(cluster), timeout_s=60,
               message=f"the master reported to the manager\n{cluster.logs()}")
    client = redis.Redis.from_url(redis_url)
    prefix = f'{{"id":"x","queue":"{queue}","enqueued_at":1,"payload":{{"n":'
    try:
        fill_dead(client, keys, 100_000, prefix)
        page.goto(f"{cluster.url}/queues/{queue}/jobs?state=dead")
        assert page.locator("#page-span").inner_text() == "1 to 50 of 100,000"
        assert page.locator("tr.job-row").first.get_attribute("data-job") == "bulk-100000"
        page.click("#page-next")
        assert page.locator("#page-span").inner_text() == "51 to 100 of 100,000"
        page.click("#page-last")
        assert page.locator("#page-span").inner_text() == "99,951 to 100,000 of 100,000"
        assert page.locator("tr.job-row").last.get_attribute("data-job") == "bulk-1"
        assert page.locator('tr[data-job="bulk-1"] .job-payload summary').inner_text() == '{"n":1}'
        started = time.perf_counter()
        page.goto(f"{cluster.url}/queues/{queue}/jobs?state=dead&offset=50000")
        print(f"page at offset 50,000 of 100,000 dead letters: "
              f"{(time.perf_counter() - started) * 1000:.0f} ms")
        assert page.locator("#page-span").inner_text() == "50,001 to 50,050 of 100,000"
    finally:
        client.delete(*keys)
        client.close()
