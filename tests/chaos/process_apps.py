"""The application of the process-fault rows (tests/chaos/test_process_faults.py).

Queue names carry ``QC_P_PREFIX`` so rows never share a queue. Every handler records to
the chaos ledger (``QC_CHAOS_LEDGER``): ``start`` before the work, ``finish`` after it.
A job that hangs or hogs on purpose also records ``alive`` lines every 5 ms from a thread
of its slot (its last sign of life) and, for the hog, a ``hogged`` line once its memory is
far over the limit; the ledger's arithmetic ignores those events, the rows read them.

A job misbehaves on its first run only (an O_EXCL marker file in ``<ledger>/first/``, so a
take charged by someone else's crash does not change that); its later run finishes.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from qcluster import App, Job
from tests.chaos.ledger import JOB_ID, LEDGER_ENV, record

PREFIX = os.environ.get("QC_P_PREFIX", "p")
ALIVE_EVERY_S = 0.005
#: Hung-slot queue: the tightest pair the policy allows at 1.5 s (margin max(1 s, 10%)).
HANG_BATCH_TIMEOUT_S = 1.5
HANG_LOCK_TIMEOUT_S = 2.5
#: Memory hog: killed at memory_kill_factor (2) x this; it dirties HOG_MB at once.
HOG_LIMIT_MB = 20.0
HOG_MB = 64
HOG_BATCH_TIMEOUT_S = 8.0
HOG_LOCK_TIMEOUT_S = 10.0

app = App("chaos-process-faults")


def _first_run(job: Job) -> bool:
    directory = Path(os.environ.get(LEDGER_ENV, "/tmp")) / "first"
    directory.mkdir(exist_ok=True)
    try:
        os.close(os.open(directory / str(job.payload[JOB_ID]),
                         os.O_WRONLY | os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


def _keep_saying_alive(job: Job) -> None:
    """A thread of the slot that records ``alive`` until the process dies."""
    def loop() -> None:
        while True:
            record("alive", [job])
            time.sleep(ALIVE_EVERY_S)

    threading.Thread(target=loop, daemon=True).start()


@app.queue(f"{PREFIX}-flow", batch_size=10, lock_timeout=3.0)
def flow(jobs: list[Job]) -> None:
    """``work_ms`` per job (payload; default 2 ms). batch_timeout 2 s, derived from the
    3 s lock: keep work_ms x 10 well below it."""
    record("start", jobs)
    time.sleep(sum(float(job.payload.get("work_ms", 2)) for job in jobs) / 1000)
    record("finish", jobs)


@app.queue(f"{PREFIX}-hang", batch_size=1, lock_timeout=HANG_LOCK_TIMEOUT_S,
           batch_timeout=HANG_BATCH_TIMEOUT_S, max_attempts=10)
def hang(jobs: list[Job]) -> None:
    """``mode`` in the payload: ``stop`` (the slot SIGSTOPs itself), ``busy`` (a pure CPU
    loop), ``sleep`` (one sleep far past the deadline). Only the first run hangs."""
    (job,) = jobs
    record("start", jobs)
    if _first_run(job):
        mode = job.payload.get("mode")
        if mode == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        _keep_saying_alive(job)
        if mode == "busy":
            while True:
                pass
        time.sleep(3600)
    record("finish", jobs)


@app.queue(f"{PREFIX}-hog", batch_size=1, private_dirty_limit_mb=HOG_LIMIT_MB,
           lock_timeout=HOG_LOCK_TIMEOUT_S, batch_timeout=HOG_BATCH_TIMEOUT_S, max_attempts=10)
def hog(jobs: list[Job]) -> None:
    """The first run dirties HOG_MB (over 2 x the limit) at once, says so, then waits to be
    killed for memory (its batch deadline is far later)."""
    (job,) = jobs
    record("start", jobs)
    if _first_run(job):
        ballast = b"\x01" * (HOG_MB << 20)  # written, so private dirty, not lazily zeroed
        record("hogged", jobs, kind=str(len(ballast)))
        _keep_saying_alive(job)
        time.sleep(3600)
    record("finish", jobs)
