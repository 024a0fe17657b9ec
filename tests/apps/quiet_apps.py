"""Three quiet queues for the live planning test (tests/e2e/test_quiet_queues.py): short
jobs, each recorded with the time it started. Queue names carry the test's prefix."""

from __future__ import annotations

import os
import time

from qcluster import App, Job

PREFIX = os.environ.get("QC_TEST_PREFIX", "quiet")
LOG_DIR = os.environ.get("QC_TEST_LOG_DIR", "/tmp")

app = App("quiet-tests")


def _started(queue: str, jobs: list[Job]) -> None:
    now = time.time()
    line = "".join(f"{queue} {job.payload['at']} {now}\n" for job in jobs)
    fd = os.open(f"{LOG_DIR}/started-{os.getpid()}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


@app.queue(f"{PREFIX}-often")
def often(jobs: list[Job]) -> None:
    _started("often", jobs)


@app.queue(f"{PREFIX}-sometimes")
def sometimes(jobs: list[Job]) -> None:
    _started("sometimes", jobs)


@app.queue(f"{PREFIX}-rarely")
def rarely(jobs: list[Job]) -> None:
    _started("rarely", jobs)
