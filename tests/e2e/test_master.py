"""`qcluster master` as a real process: slots per queue, recycle, hung and crashed slots,
no orphans, copy-on-write, metrics."""

from __future__ import annotations

import json
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from qcluster.client import Client
from tests.conftest import free_port, wait_until
from tests.e2e.cluster import Procs, executed, get_json, get_text, pid_alive

APP = "tests.apps.master_apps"


@pytest.fixture
def prefix() -> str:
    return f"m{uuid.uuid4().hex[:8]}"


@pytest.fixture
def procs(tmp_path: Path, prefix: str) -> Iterator[Procs]:
    logs = tmp_path / "executed"
    logs.mkdir()
    running = Procs(tmp_path, {"QC_TEST_PREFIX": prefix, "QC_TEST_LOG_DIR": str(logs),
                               "QCLUSTER_METRICS_DIR": str(tmp_path / "metrics")})
    yield running
    running.stop_all()


def start_master(procs: Procs, broker_url: str, slots: str, *extra: str) -> int:
    port = free_port()
    procs.start("master", "master", "--app", APP, "--broker", broker_url, "--slots", slots,
                "--listen", f"127.0.0.1:{port}", "--host-name", "test", *extra)
    wait_until(lambda: _slots_up(port), timeout_s=60, message="master slots up")
    return port


def _slots_up(port: int) -> bool:
    try:
        slots = get_json(port, "/api/v1/slots")
    except OSError:
        return False
    return bool(slots) and all(s["state"] != "starting" for s in slots)


def by_queue(port: int) -> dict[str, int]:
    counts: dict[str, int] = {}
    for slot in get_json(port, "/api/v1/slots"):
        counts[slot["queue"]] = counts.get(slot["queue"], 0) + 1
    return counts


def restarts(port: int, reason: str) -> float:
    families = text_string_to_metric_families(get_text(port, "/metrics"))
    return sum(s.value for f in families if f.name == "qcluster_slot_restarts"
               for s in f.samples if s.name.endswith("_total") and s.labels["reason"] == reason)


def test_slots_per_queue_process_jobs(procs: Procs, broker_url: str, prefix: str) -> None:
    port = start_master(procs, broker_url, f"{prefix}-work=3,{prefix}-high=1")
    assert by_queue(port) == {f"{prefix}-work": 3, f"{prefix}-high": 1}
    logs = Path(procs.env["QC_TEST_LOG_DIR"])
    with Client(broker_url) as client:
        client.enqueue_many(f"{prefix}-work", [{"n": n} for n in range(300)])
        wait_until(lambda: len(executed(logs)) == 300, timeout_s=60, message="300 jobs done")
        wait_until(lambda: client.stats(f"{prefix}-work")["locked"] == 0, timeout_s=60)
        assert client.stats(f"{prefix}-work") == {"ready": 0, "locked": 0, "delayed": 0, "dead": 0}
        client.purge(f"{prefix}-work")


def test_leaking_slot_recycles_and_metrics_files_stay_bounded(
    procs: Procs, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    port = start_master(procs, redis_url, f"{prefix}-leak=6")
    with Client(redis_url) as client:
        client.enqueue_many(f"{prefix}-leak", [{"n": n} for n in range(3000)])
        # 6 slots and 50 recycles are 56 slot processes: metrics files named per process
        # would exceed the bound below, files named per slot number stay within it.
        wait_until(lambda: restarts(port, "recycle") >= 50, timeout_s=240,
                   message="50 recycles")
        client.purge(f"{prefix}-leak")
    for slot in get_json(port, "/api/v1/slots"):
        assert slot["private_dirty_bytes"] < 2 * 40 * (1 << 20)  # memory stays bounded
    files = [f for f in (tmp_path / "metrics" / "test").iterdir() if f.suffix == ".db"]
    assert len(files) <= 6 * 8, sorted(f.name for f in files)  # per slot number, not per pid
    text = get_text(port, "/metrics")
    names = {f.name for f in text_string_to_metric_families(text)}
    for name in ("qcluster_host_capacity_slots", "qcluster_slots", "qcluster_slot_pss_bytes",
                 "qcluster_slot_private_dirty_bytes", "qcluster_slot_restarts",
                 "qcluster_slot_last_seen_timestamp_seconds", "qcluster_jobs"):
        assert name in names, name


def test_hung_slot_is_killed_and_its_job_done_later(
    procs: Procs, broker_url: str, prefix: str
) -> None:
    port = start_master(procs, broker_url, f"{prefix}-hang=2")
    logs = Path(procs.env["QC_TEST_LOG_DIR"])
    with Client(broker_url) as client:
        client.enqueue(f"{prefix}-hang", {"n": 7})
        wait_until(lambda: restarts(port, "hung") >= 1, timeout_s=60, message="hung kill")
        wait_until(lambda: executed(logs)[7] == 1, timeout_s=60, message="job 7 done later")
        # Its ack goes with the slot's next take (deferred settle), just after the job ran.
        wait_until(lambda: client.stats(f"{prefix}-hang")["locked"] == 0, timeout_s=30,
                   message="job 7 acked")


def test_killed_slot_restarts_and_nothing_is_lost(
    procs: Procs, broker_url: str, prefix: str
) -> None:
    port = start_master(procs, broker_url, f"{prefix}-work=2")
    logs = Path(procs.env["QC_TEST_LOG_DIR"])
    with Client(broker_url) as client:
        client.enqueue_many(f"{prefix}-work", [{"n": n} for n in range(2000)])
        wait_until(lambda: len(executed(logs)) > 100, timeout_s=60)
        victim = get_json(port, "/api/v1/slots")[0]["pid"]
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: restarts(port, "crash") >= 1, timeout_s=60, message="crash counted")
        wait_until(lambda: len(executed(logs)) == 2000, timeout_s=60, message="all 2000 done")
        assert victim not in {s["pid"] for s in get_json(port, "/api/v1/slots")}
        client.purge(f"{prefix}-work")


def test_no_slot_survives_a_killed_master(procs: Procs, redis_url: str, prefix: str) -> None:
    port = start_master(procs, redis_url, f"{prefix}-work=3")
    pids = [s["pid"] for s in get_json(port, "/api/v1/slots")]
    master = procs.started[0]
    os.kill(master.pid, signal.SIGKILL)
    master.wait()
    wait_until(lambda: not any(pid_alive(pid) for pid in pids), timeout_s=60,
               message="every slot gone with its master")


def test_slots_share_the_imported_memory(
    procs: Procs, redis_url: str, prefix: str
) -> None:
    procs.env["QC_TEST_BALLAST_MB"] = "200"
    # The memory formula alone: a 1-minute load above 4 per CPU (a busy test machine) caps
    # capacity at 4 x CPUs whatever the memory, the rule tests/unit/test_capacity.py checks.
    procs.env["QCLUSTER_MASTER"] = json.dumps({"max_load_per_cpu": 1e6})
    port = start_master(procs, redis_url, f"{prefix}-work=4")
    wait_until(lambda: all(s["pss_bytes"] for s in get_json(port, "/api/v1/slots")),
               timeout_s=60, message="slot PSS measured")
    host = get_json(port, "/api/v1/host")
    mib = 1 << 20
    # Without copy-on-write, 4 slots + the master would need 5 x 200 MiB.
    assert host["pss_total_bytes"] < 2 * 200 * mib + 200 * mib, host
    slots = get_json(port, "/api/v1/slots")
    expected_avg = host["pss_total_bytes"] // len(slots)
    assert abs(host["avg_slot_pss_bytes"] - expected_avg) <= 0.25 * expected_avg
    budget = host["pss_total_bytes"] + host["mem_available_bytes"] - 512 * mib
    assert host["capacity_slots"] == min(256, budget // host["avg_slot_pss_bytes"]) or (
        abs(host["capacity_slots"] - budget // host["avg_slot_pss_bytes"]) <= 2)


def test_sigterm_drains_and_exits_zero(procs: Procs, redis_url: str, prefix: str) -> None:
    port = start_master(procs, redis_url, f"{prefix}-work=2")
    pids = [s["pid"] for s in get_json(port, "/api/v1/slots")]
    master = procs.started[0]
    os.killpg(master.pid, signal.SIGTERM)
    assert master.wait(timeout=30) == 0
    assert not any(pid_alive(pid) for pid in pids)
