"""The app of tests/e2e/test_crash_attempts.py: a per-job queue whose poison jobs kill
their slot (``os._exit``) and whose every run is written down first."""

from __future__ import annotations

import json
import os
import time

from qcluster import App, Job

PREFIX = os.environ.get("QC_TEST_PREFIX", "c")
LOG_DIR = os.environ.get("QC_TEST_LOG_DIR", "/tmp")
MAX_ATTEMPTS = 3

app = App("crash-attempts")


def record(kind: str, job: Job) -> None:
    """One line per event, written before anything else happens (a crash follows)."""
    line = json.dumps({"event": kind, "id": job.id, "attempt": job.attempts,
                       "pid": os.getpid(), "t": time.monotonic()}) + "\n"
    fd = os.open(f"{LOG_DIR}/runs-{os.getpid()}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


# One slot takes the whole batch of 8 in one take; lock_timeout 3 s: without the master
# giving a dead slot's jobs back, they return only when their locks expire.
@app.job_queue(f"{PREFIX}-crash", batch_size=8, lock_timeout=3.0, batch_timeout=2.0,
               max_attempts=MAX_ATTEMPTS)
def crash(job: Job) -> None:
    record("start", job)
    if isinstance(job.payload, dict) and job.payload.get("poison"):
        os._exit(70)
    record("finish", job)
