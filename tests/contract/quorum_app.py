"""The application the quorum-queue chaos test runs in real ``qcluster slot`` processes.
The queue name comes from the environment (tests never share a queue)."""

from __future__ import annotations

import os
import time

from qcluster import App, Job

QUEUE = os.environ.get("QC_TEST_QUEUE", "quorum-test")
LOG_DIR = os.environ.get("QC_TEST_LOG_DIR", "/tmp")

app = App("quorum-tests")


@app.queue(QUEUE, batch_size=10, lock_timeout=20.0, max_attempts=5)
def record(jobs: list[Job]) -> None:
    """~20 ms per job, then one line per job, "PAYLOAD ATTEMPTS", in this process's log
    (written before the ack: a slot killed after it runs the job again elsewhere)."""
    time.sleep(0.02 * len(jobs))
    line = "".join(f"{job.payload} {job.attempts}\n" for job in jobs)
    fd = os.open(f"{LOG_DIR}/done-{os.getpid()}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
