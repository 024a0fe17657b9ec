"""The app of the periodic-job soak test (tests/e2e/test_periodic_soak.py): a job every
second, declared with ``@app.periodic`` (the manager imports this module for it), whose
handler records each tick it runs with when it was enqueued and when it ran. The names carry
a per-test prefix from the environment."""

from __future__ import annotations

import os
import time

from qcluster import App, Job

PREFIX = os.environ.get("QC_TEST_PREFIX", "p")
LOG_DIR = os.environ.get("QC_TEST_LOG_DIR", "/tmp")

app = App("periodic-tests")


@app.periodic(every=1, queue=f"{PREFIX}-tick", name=f"{PREFIX}-beat", catch_up=1000,
              missed_after=1, payload={"from": "app"})
@app.queue(f"{PREFIX}-tick", batch_size=10, min_slots=1, max_slots=1)
def tick(jobs: list[Job]) -> None:
    """One line per job: tick (ms), enqueued_at and ran_at (s)."""
    now = time.time()
    lines = "".join(f"{job.headers['qcluster-tick']} {job.enqueued_at} {now}\n" for job in jobs
                    if job.payload == {"from": "app"})
    fd = os.open(f"{LOG_DIR}/ticks-{os.getpid()}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.write(fd, lines.encode())
    finally:
        os.close(fd)
