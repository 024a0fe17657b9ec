"""Applications the benchmarks run (queue name and batch size from the environment)."""

from __future__ import annotations

import os

from qcluster import App, Job

QUEUE = os.environ.get("QB_QUEUE", "bench-noop")
BATCH = int(os.environ.get("QB_BATCH", "100"))
#: MiB allocated and touched at import (the memory suite's "big application").
BALLAST = bytearray(int(os.environ.get("QB_BALLAST_MB", "0")) << 20)
for _page in range(0, len(BALLAST), 4096):
    BALLAST[_page] = 1

app = App("bench")


@app.queue(QUEUE, batch_size=BATCH, max_slots=64)
def noop(jobs: list[Job]) -> None:
    """Does nothing: what is measured is the framework and the broker."""
