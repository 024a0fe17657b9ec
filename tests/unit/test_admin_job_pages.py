"""The job browser's pages rendered by the manager's app over a real Redis: a job found by id,
a queue's dead letters a page at a time with their payload as JSON and their traceback,
per-job and ticked requeue and delete refused without the token."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st

from qcluster.admin_ui.jobs_view import PAGE_SIZE, Pages, page_offset, pretty_json
from qcluster.broker import open_broker
from qcluster.config import load_settings
from qcluster.manager.api.app import create_app
from qcluster.manager.service import ManagerService
from qcluster.manager.state import ClusterState
from tests.contract.test_jobs_api import dead_letters

TOKEN = "job-pages-token-5d1c8e"


@pytest.fixture
def http(redis_url: str, queue_name: str) -> Iterator[TestClient]:
    broker = open_broker(redis_url)
    service = ManagerService(ClusterState(load_settings(None)), broker, TOKEN)
    with TestClient(create_app(service), base_url="http://127.0.0.1") as client:
        yield client
    broker.purge(queue_name)
    broker.delete_dead(queue_name, [f"{queue_name}-j{n}" for n in range(60)])
    broker.close()


def test_search_listing_and_actions(http: TestClient, redis_url: str, queue_name: str) -> None:
    # Ids of this queue alone: a lookup by id searches every queue the broker knows, and
    # other tests on the same private Redis leave jobs named j7 in theirs.
    j1, j2, j7 = (f"{queue_name}-j{n}" for n in (1, 2, 7))
    dead_letters(redis_url, queue_name, [f"{queue_name}-j{n}" for n in range(60)])
    found = http.get("/jobs", params={"id": j7})
    assert found.status_code == 200 and 'id="job-state">dead<' in found.text
    assert "Traceback" in found.text and "raised ValueError" in found.text
    assert f"&#34;n&#34;: &#34;{j7}&#34;" in found.text  # the payload as JSON, not the envelope
    assert "enqueued_at" not in found.text
    missing = http.get("/jobs", params={"id": "nope"})
    assert missing.status_code == 404 and 'id="job-unknown"' in missing.text

    first = http.get(f"/queues/{queue_name}/jobs", params={"state": "dead"}).text
    assert f"1 to {PAGE_SIZE} of 60" in first and first.count('class="job-row"') == PAGE_SIZE
    last = http.get(f"/queues/{queue_name}/jobs", params={"state": "dead", "offset": 999})
    assert "51 to 60 of 60" in last.text
    huge = http.get(f"/queues/{queue_name}/jobs",
                    params={"state": "dead", "offset": 10**20})
    assert huge.status_code == 200 and "51 to 60 of 60" in huge.text

    refused = http.post(f"/queues/{queue_name}/dead/delete", data={"one": j7})
    assert refused.status_code == 401
    assert http.get("/jobs", params={"id": j7}).status_code == 200
    deleted = http.post(f"/queues/{queue_name}/dead/delete",
                        data={"one": j7, "token": TOKEN})
    assert deleted.status_code == 200 and "Deleted 1 dead job" in deleted.text
    assert http.get("/jobs", params={"id": j7}).status_code == 404
    ticked = http.post(f"/queues/{queue_name}/dead/requeue",
                       data={"ids": [j1, j2], "token": TOKEN})
    assert "Requeued 2 dead job" in ticked.text
    state = re.search(r'id="job-state">(\w+)<', http.get("/jobs", params={"id": j1}).text)
    assert state is not None and state.group(1) == "ready"


@given(st.integers(-10, 10**7), st.integers(0, 10**7))
def test_a_page_offset_is_aligned_and_within_the_listing(offset: int, total: int) -> None:
    aligned = page_offset(offset, total)
    assert aligned % PAGE_SIZE == 0 and aligned >= 0
    assert total == 0 or aligned < total
    pages = Pages(aligned, min(PAGE_SIZE, max(0, total - aligned)), total)
    assert pages.next is None or pages.next < total
    assert pages.previous is None or pages.previous < aligned


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(),
                    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner)))
def test_pretty_json_never_fails_and_is_bounded(payload: object) -> None:
    text = pretty_json(payload, limit=300)
    assert len(text) <= 300 + 40
