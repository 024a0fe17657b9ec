"""A failure hook that takes longer than the master's heartbeat timeout, on a real
``qcluster master`` (embedded broker): the failed job is settled before the hook runs
(dead-lettered with its last error while the hook still waits), and the slot keeps its
heartbeat while it waits, so the master never kills it as hung."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from qcluster.client import Client
from qcluster.master.supervisor import TICK_S
from tests.conftest import free_port, wait_until
from tests.e2e.cluster import Procs, get_json

APP = "tests.e2e.slow_hook_app:app"
HEARTBEAT_TIMEOUT_S = 2.0


@pytest.mark.parametrize("broker_url", ["embedded"], indirect=True)
def test_a_hook_slower_than_the_heartbeat_timeout_changes_no_outcome(
    procs: Procs, broker_url: str, prefix: str, logs: Path, tmp_path: Path
) -> None:
    queue = f"{prefix}-doomed"
    config = tmp_path / "qcluster.toml"
    config.write_text(f"[master]\nheartbeat_timeout_s = {HEARTBEAT_TIMEOUT_S}\n")
    procs.env["QCLUSTER_CONFIG"] = str(config)
    port = free_port()
    procs.start("master", "master", "--app", APP, "--broker", broker_url,
                "--slots", f"{queue}=1", "--listen", f"127.0.0.1:{port}")
    wait_until(lambda: _slot_pids(port), timeout_s=60, message="master and slot up")
    with Client(broker_url) as client:
        job_id = client.enqueue(queue, "x")
        # The hook waits for the release file: the job is settled all the same.
        wait_until(lambda: client.stats(queue)["dead"] == 1, timeout_s=60,
                   message="the job dead-lettered while its hook still waits")
        (dead,) = client.dead_jobs(queue)
        assert dead.id == job_id and dead.reason.startswith(
            "attempt 1 of 1 raised and no attempt is left"), dead.reason
        assert dead.error is not None and dead.error.type.endswith("DoomedError")
        pids = _slot_pids(port)
        hook_log = logs / "hook.log"
        assert not hook_log.exists()
        # Past the heartbeat timeout (and the master's next look) with the hook waiting.
        time.sleep(HEARTBEAT_TIMEOUT_S + 2 * TICK_S)
        assert "hung" not in procs.log("master")
        assert _slot_pids(port) == pids, "the slot was restarted"
        assert not hook_log.exists(), "the hook gave up before the test released it"
        (logs / "release").touch()
        wait_until(hook_log.exists, timeout_s=60, message="the hook returned")
    [record] = [json.loads(line) for line in hook_log.read_text().splitlines()]
    assert record == {"ids": [job_id], "next": "dead", "pid": pids[0]}


def _slot_pids(port: int) -> list[int]:
    try:
        slots = get_json(port, "/api/v1/slots")
    except OSError:
        return []
    return sorted(int(s["pid"]) for s in slots if s.get("pid"))
