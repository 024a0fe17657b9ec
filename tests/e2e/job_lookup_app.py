"""The app of tests/e2e/test_job_lookup.py: a job that fails twice then succeeds (its first
run waits for a gate file, so that it can be seen running) and one that always fails."""

from __future__ import annotations

import os
import time

from qcluster import App, Job

PREFIX = os.environ.get("QC_TEST_PREFIX", "l")
LOG_DIR = os.environ.get("QC_TEST_LOG_DIR", "/tmp")
#: Retries come back 1.5 to 3 s later (backoff in [0.5, 1] of 3 s): long enough to be seen.
RETRY = {"retry_base_delay": 3.0, "retry_max_delay": 3.0}

app = App("job-lookup")


class MailServerGone(Exception):
    """What the flaky job raises on its first two attempts."""


@app.job_queue(f"{PREFIX}-flaky", max_attempts=5, **RETRY)
def flaky(job: Job) -> dict[str, int]:
    gate = os.path.join(LOG_DIR, "gate")
    deadline = time.monotonic() + 60
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.02)
    if job.attempts < 3:
        raise MailServerGone(f"attempt {job.attempts}: 421 try again later")
    with open(os.path.join(LOG_DIR, f"finished-{job.id}"), "w") as done:
        done.write(str(job.attempts))
    return {"sent": job.attempts}


@app.job_queue(f"{PREFIX}-poison", max_attempts=2, **RETRY)
def poison(job: Job) -> None:
    raise ValueError(f"cannot parse {job.payload!r}")
