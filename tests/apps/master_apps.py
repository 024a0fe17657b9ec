"""Applications the master and manager tests run. Queue names carry a per-test prefix from
the environment so concurrent runs on the shared brokers never share a queue."""

from __future__ import annotations

import os
import time

from qcluster import App, Job

PREFIX = os.environ.get("QC_TEST_PREFIX", "m")
LOG_DIR = os.environ.get("QC_TEST_LOG_DIR", "/tmp")
#: Allocated at import, before the master forks: shared copy-on-write by every slot.
BALLAST = bytearray(int(os.environ.get("QC_TEST_BALLAST_MB", "0")) << 20)
for _page in range(0, len(BALLAST), 4096):
    BALLAST[_page] = 1  # touch every page so it is really resident

app = App("master-tests")
_leak: list[bytes] = []


def _record(jobs: list[Job]) -> None:
    line = "".join(f"{job.payload['n']}\n" for job in jobs)
    fd = os.open(f"{LOG_DIR}/executed-{os.getpid()}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


@app.queue(f"{PREFIX}-work", batch_size=20, lock_timeout=3.0, batch_timeout=2.0)
def work(jobs: list[Job]) -> None:
    """~5 ms per job; records every execution."""
    time.sleep(0.005 * len(jobs))
    _record(jobs)


@app.queue(f"{PREFIX}-leak", batch_size=1, private_dirty_limit_mb=40.0, lock_timeout=5.0,
           batch_timeout=2.0)
def leak(jobs: list[Job]) -> None:
    """Grows private memory by 4 MiB per job, ~40 MiB/s: the slot must recycle itself."""
    time.sleep(0.1)
    _leak.append(os.urandom(4 << 20))
    _record(jobs)


@app.queue(f"{PREFIX}-hang", batch_size=1, lock_timeout=3.0, batch_timeout=1.0,
           max_attempts=10)
def hang(jobs: list[Job]) -> None:
    """Hangs on the first attempt of a job; later attempts succeed."""
    if all(job.attempts <= 1 for job in jobs):
        time.sleep(3600)
    _record(jobs)


@app.queue(f"{PREFIX}-high", priority=10, batch_size=10, max_slots=4, lock_timeout=3.0,
           batch_timeout=2.0)
def high(jobs: list[Job]) -> None:
    time.sleep(0.02 * len(jobs))
    _record(jobs)


@app.queue(f"{PREFIX}-low", priority=0, batch_size=10, max_slots=4, lock_timeout=3.0,
           batch_timeout=2.0)
def low(jobs: list[Job]) -> None:
    time.sleep(0.02 * len(jobs))
    _record(jobs)


@app.queue(f"{PREFIX}-stuck", batch_size=1, lock_timeout=1.5, max_attempts=1000)
def stuck(jobs: list[Job]) -> None:
    """Only lock_timeout set: batch_timeout is derived (0.5 s, the longest whose deadline
    plus the master's kill margin fits in the lock). max_attempts is high: a killed slot's
    read-ahead jobs may each be charged a take, and this test is about overlap, not attempts.

    The first run of a job hangs (the master kills it at its deadline), saying it is
    alive every 5 ms; later runs finish. Times are time.monotonic(), system-wide on Linux:
    the test compares a killed run's last sign of life with the next run's start."""
    (job,) = jobs
    n = job.payload["n"]
    first = _first_run(n)
    _note(f"start {n} {time.monotonic()!r}\n")
    while first:
        _note(f"alive {n} {time.monotonic()!r}\n")
        time.sleep(0.005)
    _record(jobs)


def _first_run(n: int) -> bool:
    try:
        os.close(os.open(f"{LOG_DIR}/seen-{n}", os.O_WRONLY | os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


def _note(line: str) -> None:
    fd = os.open(f"{LOG_DIR}/runs-{os.getpid()}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
