"""The application the job-browser test runs in a real master: one queue whose jobs run for a
minute (so the page has running jobs to show), named by the environment so concurrent runs
never share it."""

from __future__ import annotations

import os
import time

from qcluster import App, Job

QUEUE = os.environ.get("QC_ADMIN_QUEUE", "jobs-slow")  # as tests/browser/live_app.py

app = App("jobs-browser")


@app.queue(QUEUE, batch_size=1, min_slots=2, max_slots=2, lock_timeout=300.0,
           batch_timeout=240.0)
def slow(jobs: list[Job]) -> None:
    time.sleep(120)
