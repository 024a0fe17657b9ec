"""Issue 16 F14 on a real ``qcluster master``: a crash charges an attempt only to the job
that was running. Two poison jobs that kill their slot (``os._exit``) share one take with
healthy jobs: each poison job runs exactly ``max_attempts`` times and its dead letter says
so; every healthy job completes and none is dead-lettered. (Redis and the embedded broker:
their locks are tokens the master can present for a dead slot; on RabbitMQ the server
gives a dead consumer's jobs back itself, each charged, see docs/chaos.md.)"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from qcluster.client import Client
from tests.conftest import free_port, wait_until
from tests.e2e.cluster import Procs, get_json
from tests.e2e.crash_attempts_app import MAX_ATTEMPTS

APP = "tests.e2e.crash_attempts_app:app"


def events(logs: Path) -> dict[str, list[dict[str, Any]]]:
    """Each job's start and finish lines, in time order (CLOCK_MONOTONIC is system-wide;
    each slot writes its own file)."""
    by_job: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for path in logs.glob("runs-*.log"):
        for line in path.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a line cut by the crash
            by_job[str(event["id"])].append(event)
    for seen in by_job.values():
        seen.sort(key=lambda event: float(event["t"]))
    return by_job


@pytest.mark.parametrize("broker_url", ["redis", "embedded"], indirect=True)
def test_two_crashing_poison_jobs_in_one_take_each_run_exactly_max_attempts_times(
    procs: Procs, broker_url: str, prefix: str, logs: Path
) -> None:
    """Fails before the fix: a crash charged every job the slot held, so the second
    poison job was charged for the first one's crash and ran twice, and each dead letter
    said 4 attempts (the take that dead-lettered it counted)."""
    queue = f"{prefix}-crash"
    with Client(broker_url) as client:
        payloads = [{"n": 0}, {"n": 1}, {"poison": True}, {"n": 3}, {"n": 4},
                    {"poison": True}, {"n": 6}, {"n": 7}]
        ids = client.enqueue_many(queue, payloads)  # one take: batch_size 8
        poison = {ids[2], ids[5]}
        healthy = set(ids) - poison
        start_master(procs, broker_url, f"{queue}=2")
        wait_until(lambda: {d.id for d in client.dead_jobs(queue)} >= poison, timeout_s=120,
                   message="both poison jobs dead-lettered")
        wait_until(lambda: healthy <= finished(logs), timeout_s=60,
                   message="every healthy job finished")
        wait_until(lambda: _settled(client.stats(queue)), timeout_s=60,
                   message="nothing ready or locked")
        dead = {d.id: d for d in client.dead_jobs(queue)}
    runs = events(logs)
    for job_id in poison:
        attempts = [e["attempt"] for e in runs[job_id] if e["event"] == "start"]
        assert attempts == list(range(1, MAX_ATTEMPTS + 1)), (job_id, runs[job_id])
        assert dead[job_id].attempts == MAX_ATTEMPTS, dead[job_id]
    assert set(dead) == poison, sorted(dead)
    for job_id in healthy:
        assert any(e["event"] == "finish" for e in runs[job_id]), (job_id, runs[job_id])


def start_master(procs: Procs, broker_url: str, slots: str) -> int:
    port = free_port()
    procs.start("master", "master", "--app", APP, "--broker", broker_url, "--slots", slots,
                "--listen", f"127.0.0.1:{port}", "--host-name", "test")
    wait_until(lambda: _answers(port), timeout_s=60, message="master up")
    return port


def _answers(port: int) -> bool:
    try:
        return bool(get_json(port, "/api/v1/slots"))
    except OSError:
        return False


def finished(logs: Path) -> set[str]:
    return {job_id for job_id, seen in events(logs).items()
            if any(e["event"] == "finish" for e in seen)}


def _settled(stats: dict[str, int]) -> bool:
    return stats["ready"] == 0 and stats["locked"] == 0 and stats["delayed"] == 0
