"""Applications the benchmarks run (queue name and batch size from the environment)."""

from __future__ import annotations

import os

import bench.ballast  # noqa: F401  (the memory suite's big application)
from qcluster import App, Job

QUEUE = os.environ.get("QB_QUEUE", "bench-noop")
BATCH = int(os.environ.get("QB_BATCH", "100"))
app = App("bench")


@app.queue(QUEUE, batch_size=BATCH, max_slots=64)
def noop(jobs: list[Job]) -> None:
    """Does nothing: what is measured is the framework and the broker."""
