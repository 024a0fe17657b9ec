"""Applications used by the slot tests. Queue names come from the environment so that
concurrent test runs on the shared brokers never share a queue."""

from __future__ import annotations

import os
import time

from qcluster import App, Job

QUEUE = os.environ.get("QC_TEST_QUEUE", "slot-test")
LOG_DIR = os.environ.get("QC_TEST_LOG_DIR", "/tmp")

app = App("slot-tests")


@app.queue(QUEUE, batch_size=50, lock_timeout=2.0, batch_timeout=1.0, max_attempts=50)
def record(jobs: list[Job]) -> None:
    """Record every execution (one O_APPEND write per batch), ~1 ms per job."""
    time.sleep(0.001 * len(jobs))
    line = "".join(f"{job.payload['n']}\n" for job in jobs)
    fd = os.open(f"{LOG_DIR}/executed-{os.getpid()}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


POISON_QUEUE = os.environ.get("QC_TEST_POISON_QUEUE", "slot-test-poison")


@app.queue(POISON_QUEUE, batch_size=4, lock_timeout=2.0, batch_timeout=0.5, max_attempts=3)
def poison(jobs: list[Job]) -> None:
    """A job with payload "poison" kills its slot (os._exit) every time it runs; the
    others are recorded (one line each, after the whole batch ran)."""
    for job in jobs:
        if job.payload == "poison":
            os._exit(70)
    line = "".join(f"{job.payload}\n" for job in jobs)
    fd = os.open(f"{LOG_DIR}/poison-{os.getpid()}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
