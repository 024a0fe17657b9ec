"""The admin pages rendered by FastAPI against a fake cluster source and a real Redis."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st

from qcluster.admin_ui.charts import Series, line_chart
from qcluster.admin_ui.display import load_bar_percent, load_text
from qcluster.admin_ui.router import install
from qcluster.admin_ui.views import sort_queues
from qcluster.broker import open_broker
from qcluster.client import Client
from qcluster.config import load_settings
from qcluster.manager.api.app import create_app
from qcluster.manager.service import ManagerService
from qcluster.manager.state import ClusterState
from tests.brokers import PrivateRedis
from tests.browser.fake_source import FakeSource, queue_view
from tests.unit.test_manager_state import make_policy, report


@pytest.fixture
def client(redis_url: str, queue_name: str) -> Iterator[tuple[TestClient, FakeSource]]:
    broker = open_broker(redis_url)
    source = FakeSource(broker, queue_name)
    app = FastAPI()
    install(app, source)
    try:
        yield TestClient(app), source
    finally:
        broker.purge(queue_name)
        broker.close()


def test_overview_shows_queues_hosts_and_decisions(client: tuple[TestClient, FakeSource]) -> None:
    http, _ = client
    page = http.get("/").text
    assert 'data-queue="mail"' in page and "12,000" in page and "240%" in page
    assert 'class="queue-row resizing"' in page
    assert 'data-host="host-a"' in page and "DEAD" in page
    assert "load 240% &gt; 130%" in page


def test_sort_is_a_query_parameter(client: tuple[TestClient, FakeSource]) -> None:
    http, _ = client
    page = http.get("/?sort=backlog&dir=asc").text
    order = [page.index(f'data-queue="{name}"') for name in ("resize", "mail")]
    assert order == sorted(order)


def test_requeue_needs_the_token(
    client: tuple[TestClient, FakeSource], redis_url: str, queue_name: str
) -> None:
    http, source = client
    with Client(redis_url) as producer:
        producer.enqueue(queue_name, {"n": 1})
    deliveries = source.broker.take(queue_name, max_jobs=1, lock_timeout_s=30)
    source.broker.dead(queue_name, deliveries[0], "boom")
    assert "boom" in http.get(f"/queues/{queue_name}").text
    refused = http.post(f"/queues/{queue_name}/requeue", data={"token": "wrong"})
    assert refused.status_code == 401
    assert source.broker.stats(queue_name).dead == 1
    done = http.post(f"/queues/{queue_name}/requeue", data={"token": "s3cret"})
    assert done.status_code == 200 and "Requeued 1 dead job" in done.text
    assert source.broker.stats(queue_name).ready == 1


def test_unknown_queue_is_404(client: tuple[TestClient, FakeSource]) -> None:
    http, _ = client
    assert http.get("/queues/nope").status_code == 404


@pytest.mark.parametrize("name", ["a b", "<script>x</script>", "-x", "x" * 129, "q{1}"])
def test_requeue_of_a_name_no_queue_may_have_is_404_and_escaped(
    client: tuple[TestClient, FakeSource], name: str
) -> None:
    """The form applies the API's queue-name rule: a page, not a 500 from the broker."""
    http, _ = client
    answer = http.post(f"/queues/{quote(name, safe='')}/requeue", data={"token": "s3cret"})
    assert answer.status_code == 404
    assert "<script>x" not in answer.text  # the page's own script is the only one


def test_sort_queues_unknown_key_falls_back_to_priority() -> None:
    queues = [queue_view("a", priority=1), queue_view("b", priority=9)]
    assert [q.name for q in sort_queues(queues, "bogus", "asc")] == ["b", "a"]


def test_chart_is_svg_and_escapes_labels() -> None:
    svg = line_chart("<t>", [Series("a&b", "#000", [(0.0, 1.0), (60.0, 3.0)])])
    assert svg.startswith("<svg") and "&lt;t&gt;" in svg and "a&amp;b" in svg
    assert "no data yet" in line_chart("empty", [Series("x", "#000", [])])


def test_load_reads_as_the_real_number_or_a_dash(client: tuple[TestClient, FakeSource]) -> None:
    """Not the clipped '9999%' the console and page used to show for a queue with no slot."""
    http, source = client
    source.queues += [queue_view("burst", load=None, backlog=40_000, slots_current=0),
                      queue_view("far", load=32.0, backlog=9_000)]
    page = http.get("/").text
    row = page[page.index('data-queue="burst"'):page.index('data-queue="far"')]
    assert '<span class="load-value">—</span>' in row and "no slot ran" in row
    assert '<span class="load-value">32x</span>' in page and "9999" not in page
    assert http.get("/?sort=load&dir=desc").status_code == 200  # None sorts, as the highest
    order = [q.name for q in sort_queues(source.queues, "load", "desc")]
    assert order[:2] == ["burst", "far"]
    assert "load <span class=\"load-value\">—</span>" in http.get("/queues/burst").text


@given(st.floats(min_value=0.0, max_value=1e6))
def test_load_text_is_never_clipped(load: float) -> None:
    text = load_text(load)
    if text.endswith("%"):
        assert load < 10 and abs(float(text[:-1]) - load * 100) <= 0.5
    else:
        assert load >= 9.5 and abs(float(text[:-1].replace(",", "")) - load) <= 0.5


def test_undefined_load_is_a_dash_and_a_full_bar() -> None:
    assert load_text(None) == load_text(math.inf) == "—"
    assert load_bar_percent(None) == 100.0 and load_bar_percent(0.42) == 42.0
    assert load_bar_percent(3.2) == 100.0 and load_text(3.2) == "320%"


# --- broker warnings on the overview: undeclared queues, durability (issue 15) -----------

def _manager(url: str) -> tuple[ManagerService, TestClient]:
    service = ManagerService(ClusterState(load_settings(None)), open_broker(url), "s3cret")
    return service, TestClient(create_app(service), base_url="http://127.0.0.1")


def test_queue_with_jobs_that_no_app_declares_is_a_warning(
    redis_url: str, queue_name: str
) -> None:
    service, http = _manager(redis_url)
    declared = f"{queue_name}-declared"
    try:
        service.state.receive(report("host-a", {}, queues={declared: make_policy()}),
                              service.clock())
        with Client(redis_url) as producer:
            producer.enqueue(queue_name, {"n": 1})
            producer.enqueue(queue_name, {"n": 2})
            producer.enqueue(queue_name, {"n": 3}, delay=600)
            producer.enqueue(declared, {"n": 1})
        service.round()
        undeclared = {q.name: q for q in service.cluster_view().undeclared_queues}
        assert queue_name in undeclared and declared not in undeclared
        assert (undeclared[queue_name].ready, undeclared[queue_name].delayed) == (2, 1)
        page = http.get("/").text
        assert f'data-undeclared="{queue_name}"' in page
        assert "no app declares this queue: its jobs wait until one does" in page
        assert f'data-undeclared="{declared}"' not in page
        api = http.get("/api/v1/cluster").json()
        assert {"name": queue_name, "ready": 2, "delayed": 1} in api["undeclared_queues"]
    finally:
        service.broker.purge(queue_name)
        service.broker.purge(declared)
        service.broker.close()


def test_redis_with_aof_has_no_durability_note(redis_url: str) -> None:
    service, http = _manager(redis_url)
    try:
        service.check_broker()
        assert service.cluster_view().broker_durability == []
        assert 'id="durability"' not in http.get("/").text
    finally:
        service.broker.close()


def test_redis_without_aof_is_named_on_the_overview(tmp_path: Path) -> None:
    redis = PrivateRedis(tmp_path / "redis-no-aof", aof=False)
    service, http = _manager(redis.start())
    try:
        service.check_broker()
        notes = service.cluster_view().broker_durability
        assert notes and "appendonly" in notes[0]
        page = http.get("/").text
        assert 'id="durability"' in page and "appendonly" in page
    finally:
        service.broker.close()
        redis.stop()


def test_durability_notes_are_escaped(client: tuple[TestClient, FakeSource]) -> None:
    http, source = client
    source.durability = ["<b>snapshots</b> only"]
    page = http.get("/").text
    assert "&lt;b&gt;snapshots&lt;/b&gt; only" in page and "<b>snapshots</b>" not in page


def test_a_dead_hosts_last_slots_are_not_counted_as_running(
    client: tuple[TestClient, FakeSource],
) -> None:
    """host-b stopped reporting with 2 mail slots and the manager planned them elsewhere:
    the heading counted them as running (5 running where 3 ran, beside a queue table whose
    slots add up to 3) and tagged the dead host '1 converging', as if it were catching up."""
    http, _ = client
    page = http.get("/").text
    heading = page[page.index("<h2>Slot map"):page.index("</h2>", page.index("<h2>Slot map"))]
    assert "3 running / 3 planned" in heading
    dead_row = page[page.index('data-host="host-b"'):]
    dead_row = dead_row[:dead_row.index("</tr>")]
    assert "DEAD" in dead_row and "converging" not in dead_row
