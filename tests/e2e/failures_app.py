"""The app of tests/e2e/test_failures.py: a flaky queue (each job fails twice, then
succeeds) and a poison queue (every job always fails); a failure hook writes down each
failure it is given, and each finished job is written down too."""

from __future__ import annotations

import json
import os

from qcluster import App, Job
from qcluster.hooks import Failure

PREFIX = os.environ.get("QC_TEST_PREFIX", "f")
LOG_DIR = os.environ.get("QC_TEST_LOG_DIR", "/tmp")
FAST = {"retry_base_delay": 0.05, "retry_max_delay": 0.1}

app = App("failures")


class FlakyError(Exception):
    pass


class PoisonError(Exception):
    pass


def write(kind: str, record: dict[str, object]) -> None:
    line = json.dumps(record) + "\n"
    fd = os.open(f"{LOG_DIR}/{kind}-{os.getpid()}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


@app.job_queue(f"{PREFIX}-flaky", batch_size=1, max_attempts=5, **FAST)
def flaky(job: Job) -> None:
    if job.attempts <= 2:
        raise FlakyError(f"attempt {job.attempts} of job {job.payload} fails")
    write("finished", {"id": job.id, "attempt": job.attempts})


@app.job_queue(f"{PREFIX}-poison", batch_size=10, max_attempts=2, **FAST)
def poison(job: Job) -> None:
    raise PoisonError(f"job {job.payload} can never work")


@app.on_failure
def seen(failure: Failure) -> None:
    write("hook", {"queue": failure.queue, "ids": [job.id for job in failure.jobs],
                   "next": failure.next, "attempt": failure.attempt,
                   "exception": type(failure.exception).__name__,
                   "traceback": "Traceback" in failure.traceback})
