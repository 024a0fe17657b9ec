"""The application of the fleet page test: ``QC_FLEET_QUEUES`` queues (40 by default) named
after ``QC_TEST_PREFIX``, no-op handlers; every fourth queue keeps one slot (min_slots=1),
so the slot map has cells spread over the hosts."""

from __future__ import annotations

import os

from qcluster import App, Job

app = App("fleet-page")
PREFIX = os.environ.get("QC_TEST_PREFIX", "fleet")


def queue_names(count: int, prefix: str = PREFIX) -> list[str]:
    return [f"{prefix}-q{index:02d}" for index in range(count)]


def _noop(jobs: list[Job]) -> None:
    return None


for _index, _name in enumerate(queue_names(int(os.environ.get("QC_FLEET_QUEUES", "40")))):
    app.queue(_name, min_slots=1 if _index % 4 == 0 else 0, max_slots=4,
              priority=_index % 5)(_noop)
