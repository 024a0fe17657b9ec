"""The async benchmark's qcluster app: an ``async def`` per-job handler awaiting a 10 ms I/O
(``asyncio.sleep``) per job. Queue, batch size and concurrency from the environment."""

from __future__ import annotations

import asyncio
import os

from qcluster import App, Job

QUEUE = os.environ.get("QB_QUEUE", "bench-async")
BATCH = int(os.environ.get("QB_BATCH", "100"))
CONCURRENCY = int(os.environ.get("QB_CONCURRENCY", "100"))
IO_S = float(os.environ.get("QB_IO_S", "0.01"))
app = App("bench-async")


@app.job_queue(QUEUE, batch_size=BATCH, concurrency=CONCURRENCY, max_slots=64)
async def wait_for_io(job: Job) -> None:
    """Awaits a 10 ms I/O: what is measured is how many such waits one process overlaps."""
    await asyncio.sleep(IO_S)
