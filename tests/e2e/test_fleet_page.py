"""A small fleet on the admin page: 10 real ``qcluster master`` processes serving an app of 40
queues, one real manager, the private Redis, the overview in a real Chromium. Every master gets
its row, each row carries the host's whole share of the slot map (its queues that matter
first, the rest counted and one click away), and a queue filter turns the map back into a
grid of the chosen queues whose every cell agrees with /api/v1/cluster."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page

from tests.browser.chromium import screenshot
from tests.browser.fleet_app import queue_names
from tests.conftest import free_port, wait_until
from tests.e2e.cluster import Procs, try_json

pytestmark = pytest.mark.browser
MASTERS, QUEUES = 10, 40
TOKEN = "fleet-page-token-0c4f2b"


def _settled(port: int, hosts: set[str]) -> dict[str, Any] | None:
    """The view once every master reports, every queue is known and every host runs what
    the manager planned for it (None until then)."""
    view = try_json(port, "/api/v1/cluster")
    if view is None or {h["name"] for h in view["hosts"] if h["alive"]} != hosts:
        return None
    if len(view["queues"]) != QUEUES or not any(view["slot_map"].values()):
        return None
    converged = all(h["slots"] == {q: n for q, n in h["planned"].items() if n}
                    for h in view["hosts"])
    return dict(view) if converged else None


def _cells(host: dict[str, Any]) -> dict[str, tuple[int, int]]:
    names = {q for q, n in host["planned"].items() if n} | {q for q, n in host["slots"].items()
                                                             if n}
    return {q: (host["planned"].get(q, 0), host["slots"].get(q, 0)) for q in names}


def test_every_master_gets_its_row_and_the_page_renders_the_whole_map(
        page: Page, procs: Procs, prefix: str, redis_url: str, tmp_path: Path) -> None:
    config = tmp_path / "qcluster.toml"
    config.write_text(f'token = "{TOKEN}"\nstate_dir = "{tmp_path / "state"}"\n'
                      "[master]\nmax_slots = 2\nreport_interval_s = 0.5\n"
                      "[manager]\ninterval_s = 0.5\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    common = ("--config", str(config), "--broker", redis_url)
    procs.start("manager", "manager", *common, "--listen", f"127.0.0.1:{port}")
    hosts = {f"{prefix}-h{n}" for n in range(MASTERS)}
    for host in sorted(hosts):
        procs.start(host, "master", *common, "--manager", url, "--host-name", host,
                    "--app", "tests.browser.fleet_app", "--listen", f"127.0.0.1:{free_port()}",
                    "--no-metrics")
    view: dict[str, Any] = {}

    def settled() -> bool:
        view.update(_settled(port, hosts) or {})
        return bool(view)

    wait_until(settled, message=f"{MASTERS} masters reporting {QUEUES} queues, slots as "
                                f"planned\n{procs.log('manager')[-3000:]}")

    def rows_agree() -> bool:
        """Every master's row, with the host's totals and all of its queues (shown or
        counted), as the API says before and after the page was read."""
        before = try_json(port, "/api/v1/cluster")
        page.goto(url + "/")
        after = try_json(port, "/api/v1/cluster")
        if before is None or [h["planned"] for h in before["hosts"]] != [
                h["planned"] for h in after["hosts"]]:
            return False
        rows = page.locator("#slot-map tr.host-row")
        assert sorted(rows.evaluate_all("rs => rs.map(r => r.dataset.host)")) == sorted(hosts)
        for host in after["hosts"]:
            row = page.locator(f'#slot-map tr[data-host="{host["name"]}"]')
            cells = _cells(host)
            planned, running = (sum(p for p, _ in cells.values()),
                                sum(r for _, r in cells.values()))
            chips = row.locator(".chip").evaluate_all("cs => cs.map(c => c.dataset.queue)")
            more = row.locator("a.more")
            hidden = int(more.inner_text().split()[0].lstrip("+")) if more.count() else 0
            if (row.locator(".host-slots").inner_text() != f"{planned} / {running}"
                    or not set(chips) <= set(cells) or len(chips) + hidden != len(cells)):
                return False
        return True

    wait_until(rows_agree, message="every master's row as the API says")
    assert page.locator("#queues tr.queue-row").count() == 30  # the first 30 of 40
    page.click("#show-all")
    assert page.locator("#queues tr.queue-row").count() == QUEUES
    screenshot(page, "fleet-overview")

    # A host's page: all of its queues.
    busiest = max(view["hosts"], key=lambda h: len(_cells(h)))
    page.goto(f"{url}/hosts/{busiest['name']}")
    listed = page.locator("table.host-queues tbody tr").evaluate_all(
        "rows => rows.map(r => r.dataset.queue)")
    assert sorted(listed) == sorted(_cells(busiest))

    # Filtered to ten queues, the map is a grid again: every cell as the API says (read
    # again until the page and the API show the same round: the planner may move a slot).
    chosen = [q for q in queue_names(QUEUES, prefix) if q.startswith(f"{prefix}-q0")]

    def grid_agrees() -> bool:
        before = try_json(port, "/api/v1/cluster")
        page.goto(f"{url}/?q={prefix}-q0")
        after = try_json(port, "/api/v1/cluster")
        if before is None or before["slot_map"] != after["slot_map"]:
            return False
        header = page.locator("#slot-map thead th").all_inner_texts()
        assert [h for h in header if h in chosen] == chosen
        for host in after["hosts"]:
            cells = page.locator(f'#slot-map tr[data-host="{host["name"]}"] td.cell')
            expected = [("{} / {}".format(*_cells(host)[q]) if q in _cells(host) else "")
                        for q in chosen]
            if cells.all_inner_texts() != expected:
                return False
        return True

    wait_until(grid_agrees, message="the filtered grid shows the API's slot map")
