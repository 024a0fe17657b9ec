"""The chaos suite's application: ``qcluster master --app tests.chaos.apps``.

Every handler records ``start`` and ``finish`` lines in the ledger (``QC_CHAOS_LEDGER``,
see tests/chaos/ledger.py) and does what the job's payload asks, so that one set of
queues serves every row:

- ``work_ms``: sleep this long per job (default ``QC_CHAOS_WORK_MS``, 1 ms);
- ``poison``: ``"raise"`` (an exception), ``"exit"`` (``os._exit(70)``) or ``"segv"`` (a
  segmentation fault), on every attempt or, with ``poison_attempts``: N, on the first N;
- ``hang``: ``"sleep"`` (time.sleep), ``"busy"`` (a busy loop) or ``"stop"`` (the slot
  SIGSTOPs itself), on the first ``hang_attempts`` (default 1) attempts; later attempts
  finish;
- ``hog_mb``: allocate and touch this many MiB (kept by the slot: it grows), then sleep
  ``hold_s`` (default 0).

A deliberate failure writes an ``abort`` line (kind raise/exit/segv) before it happens;
hangs and hogs write nothing extra: the master kills those slots, so their runs show as
interrupted, as any fault's would.

Queue names start with ``QC_CHAOS_PREFIX`` (default ``chaos``), so rows running at the
same time on one broker never share a queue:

| queue | handler | policy |
|---|---|---|
| PREFIX-flow | batch | batch_size ``QC_CHAOS_BATCH`` (20), lock_timeout ``QC_CHAOS_LOCK_S`` (3 s) |
| PREFIX-a, PREFIX-b | batch | batch_size 10, lock_timeout 3 s, est_job_seconds 0.01 |
| PREFIX-delay | batch | batch_size 10, lock_timeout 1.5 s (rows delay far beyond it) |
| PREFIX-poison | per job | batch_size 4, lock_timeout 6 s (see F14), max_attempts |
|  |  | ``QC_CHAOS_MAX_ATTEMPTS`` (3), retry_base_delay ``QC_CHAOS_RETRY_BASE_S`` (1 s) |
| PREFIX-hang | batch | batch_size 1, lock_timeout 3 s (batch_timeout 2 s), max_attempts 10 |
| PREFIX-hog | batch | batch_size 1, private_dirty_limit_mb ``QC_CHAOS_HOG_LIMIT_MB`` (64) |
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from typing import Any

from qcluster import App, Job
from tests.chaos.ledger import record

PREFIX = os.environ.get("QC_CHAOS_PREFIX", "chaos")
WORK_MS = float(os.environ.get("QC_CHAOS_WORK_MS", "1"))
BATCH = int(os.environ.get("QC_CHAOS_BATCH", "20"))
LOCK_S = float(os.environ.get("QC_CHAOS_LOCK_S", "3"))
MAX_ATTEMPTS = int(os.environ.get("QC_CHAOS_MAX_ATTEMPTS", "3"))
RETRY_BASE_S = float(os.environ.get("QC_CHAOS_RETRY_BASE_S", "1"))
HOG_LIMIT_MB = float(os.environ.get("QC_CHAOS_HOG_LIMIT_MB", "64"))

app = App("chaos")
_hoard: list[bytearray] = []


def name(kind: str, prefix: str = PREFIX) -> str:
    """The queue ``kind`` (flow, a, b, delay, poison, hang, hog) under ``prefix``."""
    return f"{prefix}-{kind}"


def _payload(job: Job) -> dict[str, Any]:
    return job.payload if isinstance(job.payload, dict) else {}


def _act(job: Job) -> None:
    """Whatever the payload asks of this attempt, after the start line was written."""
    payload = _payload(job)
    poison = payload.get("poison")
    if poison and job.attempts <= int(payload.get("poison_attempts", 1_000_000)):
        record("abort", [job], kind=str(poison))
        if poison == "exit":
            os._exit(70)
        if poison == "segv":
            ctypes.string_at(0)  # reads address 0: SIGSEGV
        raise RuntimeError(f"poison job {payload.get('job_id')} (attempt {job.attempts})")
    hang = payload.get("hang")
    if hang and job.attempts <= int(payload.get("hang_attempts", 1)):
        if hang == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif hang == "busy":
            while True:
                pass
        else:
            time.sleep(3600)
    hog_mb = payload.get("hog_mb")
    if hog_mb:
        block = bytearray(int(float(hog_mb) * (1 << 20)))
        for page in range(0, len(block), 4096):
            block[page] = 1  # touch every page: really resident, really private
        _hoard.append(block)
    work_s = float(payload.get("work_ms", WORK_MS)) / 1000.0
    if payload.get("hold_s"):
        work_s += float(payload["hold_s"])
    if work_s > 0:
        time.sleep(work_s)


def run_batch(jobs: list[Job]) -> None:
    """Start lines for the whole batch (one write), each job's work, finish lines (one write).
    A job that raises fails the whole batch (its batch-mates are retried with it)."""
    record("start", jobs)
    for job in jobs:
        _act(job)
    record("finish", jobs)


def run_one(job: Job) -> None:
    record("start", [job])
    _act(job)
    record("finish", [job])


app.queue(name("flow"), batch_size=BATCH, lock_timeout=LOCK_S)(run_batch)
app.queue(name("a"), batch_size=10, lock_timeout=3.0, est_job_seconds=0.01)(run_batch)
app.queue(name("b"), batch_size=10, lock_timeout=3.0, est_job_seconds=0.01)(run_batch)
app.queue(name("delay"), batch_size=10, lock_timeout=1.5)(run_batch)
app.job_queue(name("poison"), batch_size=4, lock_timeout=6.0, max_attempts=MAX_ATTEMPTS,
              retry_base_delay=RETRY_BASE_S, retry_max_delay=60.0)(run_one)
app.queue(name("hang"), batch_size=1, lock_timeout=3.0, batch_timeout=2.0,
          max_attempts=10)(run_batch)
app.queue(name("hog"), batch_size=1, private_dirty_limit_mb=HOG_LIMIT_MB)(run_batch)
