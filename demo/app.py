"""The demo's application (``qcluster demo``), installed with qcluster so that the demo
runs from any folder; ``examples.app`` in a clone of the repository is the same app.

Handlers take a list of jobs (a batch) so they can group their own I/O.
"""

from __future__ import annotations

import time

from qcluster import App, Job

app = App("examples")


@app.queue("noop", batch_size=100, priority=0, max_slots=8)
def noop(jobs: list[Job]) -> None:
    """Does nothing: measures the framework itself."""


@app.queue("resize", batch_size=20, priority=5, min_slots=1, max_slots=16)
def resize(jobs: list[Job]) -> None:
    """Pretends to resize photos, ~2 ms each, in one grouped pass."""
    time.sleep(0.002 * len(jobs))


@app.queue("mail", batch_size=10, priority=1, max_slots=8, max_attempts=3)
def mail(jobs: list[Job]) -> None:
    """Sends mail; an address without '@' fails for good, 'retry' asks for a retry."""
    for job in jobs:
        address = str(job.payload.get("to", "")) if isinstance(job.payload, dict) else ""
        if "@" not in address:
            job.fail(f"invalid address {address!r}")
        elif address.startswith("retry"):
            job.retry(delay=1.0)
    time.sleep(0.001 * len(jobs))
