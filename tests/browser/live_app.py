"""The application the live admin-page test runs in real masters.

One queue, named by the environment so concurrent runs never share it: ~20 ms per job,
and a job whose payload says ``bad`` is dead-lettered with a reason (so the page has
dead jobs to show and requeue).
"""

from __future__ import annotations

import os
import time

from qcluster import App, Job

QUEUE = os.environ.get("QC_ADMIN_QUEUE", "admin-live")

app = App("admin-live")


@app.queue(QUEUE, batch_size=5, priority=5, min_slots=1, max_slots=8,
           lock_timeout=30.0, batch_timeout=10.0)
def work(jobs: list[Job]) -> None:
    for job in jobs:
        if job.payload.get("bad"):
            job.fail(f"bad payload #{job.payload['bad']}")
        else:
            time.sleep(0.02)
