"""Async handlers in a real `qcluster master`'s forked slots (issue 19 item 3): each slot
makes its own event loop after the fork, per-job concurrency holds, and a batch awaiting
forever is cancelled at its deadline with nothing lost."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from qcluster.client import Client
from tests.conftest import free_port, start_qcluster, wait_until
from tests.e2e.cluster import Procs, executed, get_json

APP = "tests.apps.async_apps"
CONCURRENCY = 10  # tests.apps.async_apps.CONCURRENCY (not imported: its queues need the env)


@pytest.fixture
def prefix() -> str:
    return f"a{uuid.uuid4().hex[:8]}"


@pytest.fixture
def procs(tmp_path: Path, prefix: str) -> Iterator[Procs]:
    logs = tmp_path / "executed"
    logs.mkdir()
    running = Procs(tmp_path, {"QC_TEST_PREFIX": prefix, "QC_TEST_LOG_DIR": str(logs)})
    yield running
    running.stop_all()


def _slots_up(port: int) -> bool:
    try:
        slots = get_json(port, "/api/v1/slots")
    except OSError:
        return False
    return len(slots) == 3 and all(s["state"] != "starting" for s in slots)


def test_async_slots_run_every_job_once_concurrently_and_survive_a_hung_batch(
    procs: Procs, broker_url: str, prefix: str
) -> None:
    port = free_port()
    procs.start("master", "master", "--app", APP, "--broker", broker_url, "--slots",
                f"{prefix}-each=2,{prefix}-hang=1", "--listen", f"127.0.0.1:{port}",
                "--host-name", "test", "--no-metrics")
    wait_until(lambda: _slots_up(port), timeout_s=60, message="master slots up")
    logs = Path(procs.env["QC_TEST_LOG_DIR"])
    each, hang = f"{prefix}-each", f"{prefix}-hang"
    with Client(broker_url) as client:
        client.enqueue_many(each, [{"n": n} for n in range(1, 301)])
        client.enqueue_many(hang, [{"n": 0}] + [{"n": n} for n in range(1001, 1005)])
        expected = set(range(1, 301)) | {0} | set(range(1001, 1005))
        wait_until(lambda: set(executed(logs)) == expected, timeout_s=90,
                   message="every job done")
        for queue in (each, hang):
            wait_until(lambda: client.stats(queue)["locked"] == 0, timeout_s=60,  # noqa: B023
                       message=f"{queue} settled")
            assert client.stats(queue) == {"ready": 0, "locked": 0, "delayed": 0, "dead": 0}
        counts = executed(logs)
        assert all(counts[n] == 1 for n in range(1, 301)), "an async job ran twice"
        peaks = [int(v) for p in logs.glob("in-flight-*.log") for v in p.read_text().split()]
        assert max(peaks) == CONCURRENCY, f"in-flight peak {max(peaks)}"
        client.purge(each)
        client.purge(hang)


def test_sigterm_during_an_async_batch_lets_it_finish_and_settle(
    tmp_path: Path, redis_url: str, prefix: str
) -> None:
    """The stop signal lands while the loop waits in its selector (every job awaits a gate
    the test opens after the signal): the batch still runs to its end, every job is acked
    once, and the slot exits 0."""
    logs = tmp_path / "logs"
    logs.mkdir()
    queue = f"{prefix}-slow"
    with Client(redis_url) as client:
        client.enqueue_many(queue, [{"n": n} for n in range(10)])
        proc = start_qcluster("slot", "--app", APP, "--queue", queue, "--broker", redis_url,
                              "--log-level", "WARNING", QC_TEST_PREFIX=prefix,
                              QC_TEST_LOG_DIR=str(logs))
        try:
            wait_until(lambda: len(_numbers(logs, "started")) == 10, timeout_s=60,
                       message="the batch of 10 started")
            os.killpg(proc.pid, signal.SIGTERM)  # every job awaits the gate: mid-batch
            (logs / "gate").touch()
            assert proc.wait(timeout=60) == 0, proc.stdout.read() if proc.stdout else ""
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        assert sorted(_numbers(logs, "executed")) == list(range(10))
        assert client.stats(queue) == {"ready": 0, "locked": 0, "delayed": 0, "dead": 0}


def _numbers(logs: Path, kind: str) -> list[int]:
    return [int(v) for p in logs.glob(f"{kind}-*.log") for v in p.read_text().split()]
