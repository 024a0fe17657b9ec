"""No job is lost when slots are SIGKILLed mid-batch, on every backend.

10,000 jobs are drained by a real `qcluster slot` process that is SIGKILLed and
restarted over and over: each new slot is killed at a random moment within half a second
of its first batch, so it dies mid-work however long it took to start on this machine.
Every job must have run at least once; duplicates (jobs whose slot died after running
them, before the ack) are reported, not forbidden.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from qcluster import Client
from tests.conftest import start_qcluster

JOBS = 10_000
KILL_EVERY_S = 0.5
#: A lost job shows up as a drain that never completes: give up after this long.
DRAIN_TIMEOUT_S = 200.0  # generous: slots start slowly on a busy CPU


def executed(log_dir: Path) -> Counter[int]:
    counts: Counter[int] = Counter()
    for log in log_dir.glob("executed-*.log"):
        counts.update(int(line) for line in log.read_text().split())
    return counts


def start_slot(broker_url: str, queue: str, log_dir: Path) -> subprocess.Popen[bytes]:
    return start_qcluster(
        "slot", "--app", "tests.apps.slot_apps", "--queue", queue, "--broker", broker_url,
        "--log-level", "WARNING", QC_TEST_QUEUE=queue, QC_TEST_LOG_DIR=str(log_dir),
    )


def wait_for_work(log_dir: Path, executions_before: int, timeout_s: float = 30.0) -> None:
    """Until the slot started last has run a batch (or ``timeout_s``: the queue may be dry)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if executed(log_dir).total() > executions_before:
            return
        time.sleep(0.01)


def drained(client: Client, queue: str, log_dir: Path) -> bool:
    """Every job ran at least once and the queue holds nothing more.

    The executions are the evidence: on RabbitMQ ``locked`` only counts this process's
    deliveries, so empty counts alone could still hide a batch in a slot's hands.
    """
    if len(set(executed(log_dir)) & set(range(JOBS))) < JOBS:
        return False
    stats = client.stats(queue)
    return stats["ready"] == stats["locked"] == stats["delayed"] == 0


def test_sigkill_every_half_second_loses_no_job(
    broker_url: str, queue_name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    client = Client(broker_url)
    client.enqueue_many(queue_name, [{"n": n} for n in range(JOBS)])
    kills = executions_before = 0
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    proc = start_slot(broker_url, queue_name, tmp_path)
    try:
        while time.monotonic() < deadline and not drained(client, queue_name, tmp_path):
            if len(executed(tmp_path)) >= JOBS * 0.9:  # the tail drains unkilled
                time.sleep(0.1)
                continue
            wait_for_work(tmp_path, executions_before)
            time.sleep(random.uniform(0, KILL_EVERY_S))
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            kills += 1
            executions_before = executed(tmp_path).total()
            proc = start_slot(broker_url, queue_name, tmp_path)
    finally:
        proc.kill()
        proc.wait()
    counts = executed(tmp_path)
    lost = JOBS - len(set(counts) & set(range(JOBS)))
    duplicates = sum(c - 1 for c in counts.values())
    with capsys.disabled():
        print(f"\n[{broker_url.split(':')[0]}] {kills} SIGKILLs, {JOBS} jobs: "
              f"lost {lost}, duplicate executions {duplicates}")
    assert kills >= 5, "the slot was not killed often enough for the test to mean anything"
    assert lost == 0, f"{lost} jobs lost"
    assert client.stats(queue_name)["dead"] == 0
    delete = getattr(client.broker, "delete_queue", None)
    if delete is not None:  # leave nothing behind on the shared brokers
        delete(queue_name)
    client.close()
