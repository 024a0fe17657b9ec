"""The shards suite's application: no-op handlers on the queues named in ``QB_QUEUES``
(comma-separated), batch ``QB_BATCH`` (see bench/shards_bench.py)."""

from __future__ import annotations

import os

from qcluster import App, Job

QUEUES = [name for name in os.environ.get("QB_QUEUES", "bench-shard").split(",") if name]
BATCH = int(os.environ.get("QB_BATCH", "100"))
app = App("bench-shards")


def noop(jobs: list[Job]) -> None:
    """Does nothing: what is measured is the framework and the broker."""


for _queue in QUEUES:
    app.queue(_queue, batch_size=BATCH, max_slots=64)(noop)
