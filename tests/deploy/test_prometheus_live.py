"""A real Prometheus server (Debian's package) scrapes a real master and manager."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from qcluster.client import Client
from qcluster.metrics import MANAGER_METRICS, MASTER_METRICS
from tests.conftest import free_port, wait_until
from tests.e2e.cluster import Procs, executed, get_text
from tests.e2e.test_manager import Cluster, write_config


@pytest.fixture
def cluster(tmp_path: Path, redis_url: str) -> Iterator[Cluster]:
    prefix = f"p{uuid.uuid4().hex[:8]}"
    logs = tmp_path / "executed"
    logs.mkdir()
    procs = Procs(tmp_path, {"QC_TEST_PREFIX": prefix, "QC_TEST_LOG_DIR": str(logs),
                             "QCLUSTER_METRICS_DIR": str(tmp_path / "metrics")})
    running = Cluster(procs, redis_url, prefix, write_config(tmp_path / "q.toml", prefix, 4))
    try:
        running.start_manager()
        running.start_master("a")
        wait_until(lambda: running.view()["hosts"], timeout_s=60, message="master reporting")
        yield running
    finally:
        procs.stop_all()
        with Client(redis_url) as client:
            client.purge(running.q("work"))


@pytest.fixture
def prometheus(tmp_path: Path, cluster: Cluster) -> Iterator[int]:
    binary = shutil.which("prometheus")
    if binary is None:  # a failure, not a skip: make test installs it
        pytest.fail("Debian's prometheus is not installed (make sysdeps installs it)")
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {"job_name": "qcluster-manager",
             "static_configs": [{"targets": [f"127.0.0.1:{cluster.port}"]}]},
            {"job_name": "qcluster-master",
             "static_configs": [{"targets": [f"127.0.0.1:{cluster.master_ports['a']}"]}]},
        ],
    }))
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: _get(port, "/-/ready") is not None, timeout_s=60,
                   message="prometheus ready")
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def _get(port: int, path: str) -> Any:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as response:
            body = response.read()
    except OSError:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return body


def query(port: int, promql: str) -> list[dict[str, Any]]:
    answer = _get(port, "/api/v1/query?query=" + urllib.parse.quote(promql))
    return list(answer["data"]["result"]) if answer else []


def test_prometheus_scrapes_master_and_manager(prometheus: int, cluster: Cluster) -> None:
    work = cluster.q("work")
    with Client(cluster.broker_url) as client:
        client.enqueue_many(work, [{"n": n} for n in range(3000)])
        wait_until(lambda: len(executed(cluster.logs)) > 0, timeout_s=60, message="jobs ran")
    wait_until(lambda: query(prometheus, f'qcluster_queue_backlog{{queue="{work}"}}'),
               timeout_s=60, message="backlog series from the manager")
    wait_until(lambda: query(prometheus,
                             f'qcluster_jobs_total{{queue="{work}",outcome="done"}}'),
               timeout_s=60, message="jobs counter from the master's slots")
    series = query(prometheus, f'qcluster_jobs_total{{queue="{work}"}}')
    assert {"queue", "outcome", "job", "instance"} <= set(series[0]["metric"])
    up = query(prometheus, "up")
    assert {s["metric"]["job"] for s in up if s["value"][1] == "1"} == {
        "qcluster-manager", "qcluster-master"}


def test_documented_metric_names_are_really_exported(cluster: Cluster) -> None:
    with Client(cluster.broker_url) as client:
        client.enqueue_many(cluster.q("work"), [{"n": n} for n in range(100)])
        wait_until(lambda: len(executed(cluster.logs)) == 100, timeout_s=60)
    text = get_text(cluster.master_ports["a"], "/metrics") + get_text(cluster.port, "/metrics")
    exported = set()
    for family in text_string_to_metric_families(text):
        exported.add(family.name)
        exported.update(sample.name for sample in family.samples)
    missing = [name for name in (*MASTER_METRICS, *MANAGER_METRICS) if name not in exported]
    assert not missing, missing
