"""One manager and two masters (distinct --host-name, same machine), real processes."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from qcluster.client import Client
from tests.conftest import free_port, wait_until
from tests.e2e.cluster import Procs, executed, get_json, try_json

APP = "tests.apps.master_apps"
INTERVAL = 0.5
#: Manager and masters share it (QCLUSTER_TOKEN): reports need it, and so does control.
TOKEN = "e2e-5b8f1c3d7a9e2f4b6c8d"


class Cluster:
    def __init__(self, procs: Procs, broker_url: str, prefix: str, config: Path) -> None:
        self.procs, self.broker_url, self.prefix, self.config = procs, broker_url, prefix, config
        self.port = free_port()
        self.masters: dict[str, Any] = {}
        self.master_ports: dict[str, int] = {}
        self.logs = Path(procs.env["QC_TEST_LOG_DIR"])

    def q(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    def start_manager(self) -> None:
        self.manager = self.procs.start(
            "manager", "manager", "--config", str(self.config), "--broker", self.broker_url,
            "--listen", f"127.0.0.1:{self.port}", "--interval", str(INTERVAL))
        wait_until(lambda: try_json(self.port, "/healthz"), timeout_s=60, message="manager up")

    def start_master(self, host: str) -> None:
        self.master_ports[host] = port = free_port()
        self.masters[host] = self.procs.start(
            f"master-{host}", "master", "--app", APP, "--config", str(self.config),
            "--broker", self.broker_url, "--manager", f"http://127.0.0.1:{self.port}",
            "--host-name", host, "--listen", f"127.0.0.1:{port}")

    def slots_of(self, host: str) -> dict[str, int]:
        """What the master itself says it runs (works without a manager)."""
        counts: dict[str, int] = {}
        for slot in get_json(self.master_ports[host], "/api/v1/slots"):
            if slot["state"] != "stopping":
                counts[slot["queue"]] = counts.get(slot["queue"], 0) + 1
        return counts

    def view(self) -> dict[str, Any]:
        return dict(get_json(self.port, "/api/v1/cluster"))

    def queue(self, name: str) -> dict[str, Any]:
        return next(q for q in self.view()["queues"] if q["name"] == self.q(name))

    def running_on(self, name: str) -> dict[str, int]:
        return {h["name"]: h["slots"].get(self.q(name), 0) for h in self.view()["hosts"]
                if h["alive"]}


def write_config(path: Path, prefix: str, master_max_slots: int) -> Path:
    path.write_text(f"""
[master]
max_slots = {master_max_slots}
report_interval_s = {INTERVAL}

[manager]
window_s = 10.0

[queues.{prefix}-work]
max_slots = 6
idle_s = 0  # no warm slot: a drained queue goes back to 0 within the test

[queues.{prefix}-leak]
max_slots = 0

[queues.{prefix}-hang]
max_slots = 0

# Declared only here, served by no master: a queue the manager plans (0 slots) and shows.
[queues.{prefix}-parked]
max_slots = 0
""")
    return path


@pytest.fixture
def cluster_factory(tmp_path: Path, redis_url: str) -> Iterator[Any]:
    made: list[Procs] = []

    def make(master_max_slots: int = 8) -> Cluster:
        prefix = f"c{uuid.uuid4().hex[:8]}"
        logs = tmp_path / f"executed-{prefix}"
        logs.mkdir()
        procs = Procs(tmp_path, {"QC_TEST_PREFIX": prefix, "QC_TEST_LOG_DIR": str(logs),
                                 "QCLUSTER_TOKEN": TOKEN,
                                 "QCLUSTER_METRICS_DIR": str(tmp_path / f"metrics-{prefix}")})
        made.append(procs)
        config = write_config(tmp_path / f"{prefix}.toml", prefix, master_max_slots)
        cluster = Cluster(procs, redis_url, prefix, config)
        cluster.start_manager()
        cluster.start_master("a")
        cluster.start_master("b")
        wait_until(lambda: len([h for h in cluster.view()["hosts"] if h["alive"]]) == 2,
                   timeout_s=60, message="both masters reporting")
        return cluster

    yield make
    for procs in made:
        procs.stop_all()
    with Client(redis_url) as client:
        for procs in made:
            for queue in ("work", "high", "low"):
                client.purge(f"{procs.env['QC_TEST_PREFIX']}-{queue}")


def test_flood_scales_out_over_both_hosts_then_shrinks(cluster_factory: Any) -> None:
    cluster = cluster_factory()
    work = cluster.q("work")
    wait_until(lambda: cluster.queue("work")["slots_current"] == 0, timeout_s=60,
               message="idle queue shrinks to its minimum (0)")
    with Client(cluster.broker_url) as client:
        client.enqueue_many(work, [{"n": n} for n in range(20_000)])
        # Within two planning intervals (plus the report that carries the backlog).
        wait_until(lambda: cluster.queue("work")["slots_planned"] >= 2,
                   timeout_s=60, message="planned slots rise")
        wait_until(lambda: all(n >= 1 for n in cluster.running_on("work").values()),
                   timeout_s=60, message="the queue runs on both hosts")
        view = cluster.view()
        reasons = [d["reason"] for d in view["decisions"] if d["queue"] == work]
        assert any("load" in r and "backlog" in r and "->" in r for r in reasons), reasons
        assert {"from", "to", "at", "queue", "reason"} <= set(view["decisions"][0])
        client.purge(work)
    wait_until(lambda: cluster.queue("work")["slots_planned"] == 0, timeout_s=60,
               message="drained queue shrinks back to its minimum")
    _check_api_shape(cluster)


def _check_api_shape(cluster: Cluster) -> None:
    view = cluster.view()
    assert set(view) >= {"queues", "hosts", "slot_map", "decisions"}
    assert set(view["queues"][0]) >= {
        "name", "priority", "min_slots", "max_slots", "slots_current", "slots_planned", "load",
        "backlog", "locked", "delayed", "dead", "rate_in", "rate_out", "mean_job_seconds"}
    assert set(view["hosts"][0]) >= {"name", "capacity_slots", "slots", "mem_available_bytes",
                                     "loadavg", "last_report_at", "alive"}
    base = f"http://127.0.0.1:{cluster.port}"
    work = cluster.q("work")
    for path in (f"/api/v1/queues/{work}/pause", f"/api/v1/queues/{work}/resume",
                 f"/api/v1/queues/{work}/requeue-dead", "/api/v1/hosts/a/drain"):
        assert httpx.post(base + path).status_code == 401
        assert httpx.post(base + path, headers={"Authorization": "Bearer nope"}).status_code == 401
    ok = httpx.post(base + f"/api/v1/queues/{work}/pause",
                    headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 200 and ok.json()["paused"] is True
    assert httpx.get(base + "/api/v1/cluster", headers={"Host": "evil.example"}).status_code == 400
    assert "qcluster_queue_backlog" in httpx.get(base + "/metrics").text
    assert "/api/v1/reports" in httpx.get(base + "/openapi.json").text


def test_higher_priority_gets_slots_first_when_capacity_is_short(cluster_factory: Any) -> None:
    cluster = cluster_factory(master_max_slots=3)  # 6 slots in the whole cluster
    with Client(cluster.broker_url) as client:
        client.enqueue_many(cluster.q("low"), [{"n": n} for n in range(5000)])
        client.enqueue_many(cluster.q("high"), [{"n": n} for n in range(5000, 10_000)])
        wait_until(lambda: cluster.queue("high")["slots_planned"] == 4, timeout_s=60,
                   message="high priority gets its maximum")
        low = cluster.queue("low")
        assert low["slots_planned"] <= 2
        assert "capacity short" in " ".join(
            d["reason"] for d in cluster.view()["decisions"] if d["queue"] == cluster.q("low")
        ) or low["slots_planned"] == 2


def test_dead_master_is_replanned_and_a_restarted_manager_rebuilds_the_map(
    cluster_factory: Any
) -> None:
    cluster = cluster_factory()
    work = cluster.q("work")
    with Client(cluster.broker_url) as client:
        client.enqueue_many(work, [{"n": n} for n in range(30_000)])
        wait_until(lambda: all(n >= 1 for n in cluster.running_on("work").values()),
                   timeout_s=60, message="work on both hosts")
        os.killpg(cluster.masters["b"].pid, signal.SIGKILL)
        wait_until(lambda: "b" not in cluster.running_on("work"),
                   timeout_s=60, message="host b declared dead")
        wait_until(lambda: "b" not in cluster.view()["slot_map"]
                   and cluster.view()["slot_map"].get("a", {}).get(work, 0)
                   == cluster.queue("work")["slots_planned"],
                   timeout_s=60, message="b's slots planned on a")
        done = len(executed(cluster.logs))
        wait_until(lambda: len(executed(cluster.logs)) > done + 500, timeout_s=60,
                   message="jobs keep flowing on a")

        before = cluster.view()["slot_map"]
        os.killpg(cluster.manager.pid, signal.SIGKILL)
        cluster.manager.wait()
        done = len(executed(cluster.logs))
        wait_until(lambda: len(executed(cluster.logs)) > done + 500, timeout_s=60,
                   message="masters keep processing without a manager")
        running = cluster.slots_of("a")
        cluster.start_manager()
        wait_until(lambda: cluster.view()["hosts"] and cluster.view()["slot_map"].get("a"),
                   timeout_s=60, message="restarted manager planned host a")
        rebuilt = {h["name"]: h["slots"] for h in cluster.view()["hosts"] if h["alive"]}
        assert rebuilt == {"a": running}, (before, rebuilt)
        assert cluster.view()["slot_map"]["a"].get(work) == before["a"].get(work)
        # Nothing lost: the jobs the killed master held come back after their lock timeout.
        wait_until(lambda: set(executed(cluster.logs)) >= set(range(30_000)), timeout_s=240,
                   message="every job executed despite the killed master and manager")

