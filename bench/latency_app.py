"""Records each job's enqueue-to-start time (producer and slot share the machine's clock)."""

from __future__ import annotations

import os
import time

from qcluster import App, Job

app = App("bench-latency")
QUEUE = os.environ.get("QB_QUEUE", "bench-latency")
LOG = os.environ.get("QB_LATENCY_LOG", "/tmp/qcluster-latency.jsonl")


@app.queue(QUEUE, batch_size=1)
def record(jobs: list[Job]) -> None:
    now = time.time()
    with open(LOG, "a") as handle:
        handle.write("".join(f"{now - job.payload['t']}\n" for job in jobs))
