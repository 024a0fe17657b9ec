"""Async handlers the end-to-end tests run in a real master's slots (issue 19 item 3).
Queue names carry a per-test prefix from the environment; every execution is recorded in
files of the test's own directory."""

from __future__ import annotations

import asyncio
import os

from qcluster import App, Job

PREFIX = os.environ.get("QC_TEST_PREFIX", "a")
LOG_DIR = os.environ.get("QC_TEST_LOG_DIR", "/tmp")
CONCURRENCY = 10

app = App("async-tests")
_in_flight = 0


def _append(name: str, line: str) -> None:
    fd = os.open(f"{LOG_DIR}/{name}-{os.getpid()}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


@app.job_queue(f"{PREFIX}-each", batch_size=20, concurrency=CONCURRENCY, lock_timeout=30.0)
async def each(job: Job) -> None:
    """A 10 ms await per job; records the job and how many of this slot's jobs were in
    flight when it started."""
    global _in_flight
    _in_flight += 1
    try:
        _append("in-flight", f"{_in_flight}\n")
        await asyncio.sleep(0.01)
        _append("executed", f"{job.payload['n']}\n")
    finally:
        _in_flight -= 1


@app.queue(f"{PREFIX}-hang", batch_size=5, batch_timeout=1.0, max_attempts=10,
           retry_base_delay=0.1, retry_max_delay=0.2)
async def hang(jobs: list[Job]) -> None:
    """A batch holding a first attempt of job 0 awaits forever (cancelled at the deadline);
    every other batch records its jobs."""
    if any(job.payload["n"] == 0 and job.attempts == 1 for job in jobs):
        await asyncio.Event().wait()
    _append("executed", "".join(f"{job.payload['n']}\n" for job in jobs))


@app.job_queue(f"{PREFIX}-slow", batch_size=10, batch_timeout=60.0)
async def slow(job: Job) -> None:
    """Records its start, awaits until the test creates the gate file, records its end: a
    stop signal sent before the gate opens arrives mid-await."""
    _append("started", f"{job.payload['n']}\n")
    while not os.path.exists(f"{LOG_DIR}/gate"):
        await asyncio.sleep(0.05)
    _append("executed", f"{job.payload['n']}\n")
