"""Issue 15 on a real ``qcluster master``: a hung slot is killed before its job's lock
expires (no job runs in two slots at once), SIGHUP does not stop the master, and the
metrics directory loses only qcluster's own files."""

from __future__ import annotations

import os
import signal
from collections import defaultdict
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from qcluster.client import Client
from qcluster.exitcodes import CONFIG
from tests.conftest import free_port, wait_until
from tests.e2e.cluster import Procs, executed, get_json, get_text
from tests.e2e.test_master import start_master

JOBS = 6


def runs(logs: Path) -> tuple[dict[int, list[float]], dict[int, float]]:
    """Start times of every run of each job, and each job's last sign of life while hung."""
    starts: dict[int, list[float]] = defaultdict(list)
    alive: dict[int, float] = {}
    for path in logs.glob("runs-*.log"):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) != 3:
                continue  # a line cut by the kill
            kind, n, at = parts[0], int(parts[1]), float(parts[2])
            if kind == "start":
                starts[n].append(at)
            else:
                alive[n] = max(alive.get(n, 0.0), at)
    return starts, alive


def test_a_hung_slot_is_killed_before_another_slot_starts_its_job(
    procs: Procs, redis_url: str, prefix: str, logs: Path
) -> None:
    """lock_timeout 1.5 s alone (refused before: the default batch_timeout was 30 s), so
    batch_timeout 0.5 s, the tightest pair the rule allows. One job at a time hangs on its
    first run while the other slots wait idle, ready to take it the moment its lock
    expires; its second run must start after the first run's last sign of life. With
    deadlines checked on a 1 s tick the kill came up to 1.2 s late. (Redis: on RabbitMQ a
    job comes back only when the killed slot's connection closes.)"""
    queue = f"{prefix}-stuck"
    start_master(procs, redis_url, f"{queue}=3")
    with Client(redis_url) as client:
        for n in range(JOBS):
            client.enqueue(queue, {"n": n})
            wait_until(lambda n=n: executed(logs)[n] >= 1, timeout_s=60,  # type: ignore[misc]
                       message=f"job {n} done on its second run")
        client.purge(queue)
    starts, alive = runs(logs)
    assert all(len(starts[n]) >= 2 for n in range(JOBS)), starts
    second_start = {n: sorted(starts[n])[1] for n in range(JOBS)}
    overlaps = {n: round(alive[n] - second_start[n], 3) for n in range(JOBS)
                if alive.get(n, 0.0) > second_start[n]}
    assert not overlaps, f"job ran in two slots at once (seconds of overlap): {overlaps}"


def test_sighup_does_not_stop_the_master_or_its_slots(
    procs: Procs, redis_url: str, prefix: str, logs: Path
) -> None:
    port = start_master(procs, redis_url, f"{prefix}-work=2")
    pids = sorted(s["pid"] for s in get_json(port, "/api/v1/slots"))
    master = procs.started[0]
    os.killpg(master.pid, signal.SIGHUP)  # the whole group, as a closed terminal does
    wait_until(lambda: "SIGHUP" in procs.log("master") or master.poll() is not None,
               timeout_s=60, message="SIGHUP logged")
    assert master.poll() is None, "the master died of SIGHUP"
    with Client(redis_url) as client:
        client.enqueue_many(f"{prefix}-work", [{"n": n} for n in range(50)])
        wait_until(lambda: len(executed(logs)) == 50, timeout_s=60, message="50 jobs done")
        client.purge(f"{prefix}-work")
    assert sorted(s["pid"] for s in get_json(port, "/api/v1/slots")) == pids
    os.kill(master.pid, signal.SIGTERM)
    assert master.wait(timeout=30) == 0


def test_master_keeps_a_users_file_in_the_metrics_directory(
    procs: Procs, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    metrics_dir = tmp_path / "metrics" / "test"  # QCLUSTER_METRICS_DIR/HOST
    metrics_dir.mkdir(parents=True)
    (metrics_dir / "notes.txt").write_text("mine")
    (metrics_dir / "counter_slot7.db").write_bytes(b"\0" * 16)  # stale: a past slot 7
    start_master(procs, redis_url, f"{prefix}-work=1")
    assert (metrics_dir / "notes.txt").read_text() == "mine"
    assert not (metrics_dir / "counter_slot7.db").exists()


def test_a_redis_that_evicts_is_refused_at_start(tmp_path: Path) -> None:
    """As slot, enqueue and manager do: exit 6 with one line, nothing forked. Before, the
    master ran on: each slot died of the refusal (exit 3) until the queue was fatal.
    (Chaos row F11, reported by N.) Regression: failed on the code before (no exit)."""
    import subprocess
    import sys

    from tests.conftest import free_port

    port = free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: _answers(port), timeout_s=60, message="redis-server up")
        result = subprocess.run(
            [sys.executable, "-m", "qcluster", "master", "--app", "tests.apps.master_apps",
             "--slots", "m-work=1", "--broker", f"redis://127.0.0.1:{port}/0",
             "--listen", f"127.0.0.1:{free_port()}", "--host-name", "t", "--no-metrics"],
            capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[2])
    finally:
        server.terminate()
        server.wait()
    assert result.returncode == 6, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "allkeys-lru" in errors[0], result.stderr
    assert "started on" not in result.stderr and "Traceback" not in result.stderr


def _answers(port: int) -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def jobs_counted(port: int, queue: str) -> float:
    families = text_string_to_metric_families(get_text(port, "/metrics"))
    return sum(s.value for f in families if f.name == "qcluster_jobs"
               for s in f.samples if s.name.endswith("_total") and s.labels.get("queue") == queue)


def test_masters_sharing_a_metrics_directory_keep_their_own_counts(
    procs: Procs, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    """QCLUSTER_METRICS_DIR shared by masters of two host names (one environment file for
    two units): each writes under its host name, and a second master of the same name is
    refused at start. Before, the later master wiped the first one's files at its start
    and its slot 0 wrote into the same files as the first one's slot 0."""
    port = start_master(procs, redis_url, f"{prefix}-work=1")
    with Client(redis_url) as client:
        client.enqueue_many(f"{prefix}-work", [{"n": n} for n in range(20)])
        wait_until(lambda: jobs_counted(port, f"{prefix}-work") >= 20, timeout_s=60,
                   message="the first master counts its 20 jobs")
        twin = procs.start("twin", "master", "--app", "tests.apps.master_apps", "--broker",
                           redis_url, "--slots", f"{prefix}-high=1", "--host-name", "test",
                           "--listen", f"127.0.0.1:{free_port()}")
        assert twin.wait(timeout=60) == CONFIG, procs.log("twin")
        assert "another master (pid " in procs.log("twin")
        assert "of host 'test' runs on this machine" in procs.log("twin")
        other = free_port()
        procs.start("other", "master", "--app", "tests.apps.master_apps", "--broker",
                    redis_url, "--slots", f"{prefix}-high=1", "--host-name", "other",
                    "--listen", f"127.0.0.1:{other}")
        wait_until(lambda: _serves(other), timeout_s=60, message="the other master's slot up")
        client.enqueue_many(f"{prefix}-high", [{"n": n} for n in range(5)])
        wait_until(lambda: jobs_counted(other, f"{prefix}-high") >= 5, timeout_s=60,
                   message="the other master counts its 5 jobs")
    assert jobs_counted(port, f"{prefix}-work") == 20  # kept through the other's start
    assert jobs_counted(port, f"{prefix}-high") == 0
    assert jobs_counted(other, f"{prefix}-work") == 0


def _serves(port: int) -> bool:
    try:
        return any(s["state"] != "starting" for s in get_json(port, "/api/v1/slots"))
    except OSError:
        return False


def test_a_master_without_a_manager_url_reports_to_the_default_one_and_says_so(
    procs: Procs, redis_url: str
) -> None:
    """`qcluster master --host-auto` with no manager_url reported nowhere and said nothing:
    it ran its queues' min_slots and no manager ever planned it. It now reports to the
    manager's default address on this machine, says so at start, and says when that
    manager does not answer (none here: no test listens on the default port)."""
    procs.start("master", "master", "--app", "tests.apps.master_apps", "--broker", redis_url,
                "--host-auto", "--host-name", "lonely", "--listen", f"127.0.0.1:{free_port()}")
    default = "http://127.0.0.1:7300"
    wait_until(lambda: f"manager {default}/api/v1/reports unreachable" in procs.log("master"),
               timeout_s=60, message="the master says the default manager does not answer")
    assert f"reporting to the manager at {default}, the default" in procs.log("master")
