"""The fleet bench's application: ``QB_FLEET_QUEUES`` queues (150 by default) with the
spread of the system qcluster comes from (150 queue types, a few busy ones and a long tail
of quiet ones, priorities and batch sizes of every kind).

Each queue's share of the load, priority, batch size and handler cost follow from its
index alone (:func:`queue_shape`), so the bench's producer and the slots agree on them."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from qcluster import App, Job

app = App("fleet")

#: Batch sizes in rotation: most queues take small batches, a few take big ones.
BATCH_SIZES = (1, 10, 10, 20, 50, 100, 1, 10)
#: Priorities in rotation: a tenth high, a third medium, the rest low.
PRIORITIES = (10, 5, 5, 1, 1, 0, 0, 0, 0, 1)


@dataclass(frozen=True)
class QueueShape:
    name: str
    weight: float
    """Share of the total arrival rate (Zipf over the queue index: a few queues carry
    most of the load, as in a real fleet)."""
    priority: int
    batch_size: int
    cost_s: float
    """Handler seconds per job."""


def queue_names(count: int) -> list[str]:
    return [f"fleet-{index:03d}" for index in range(count)]


def queue_shapes(count: int) -> list[QueueShape]:
    raw = [1.0 / (index + 1) for index in range(count)]
    total = sum(raw)
    return [QueueShape(name, raw[index] / total, PRIORITIES[index % len(PRIORITIES)],
                       BATCH_SIZES[index % len(BATCH_SIZES)],
                       0.0005 + 0.0005 * (index % 7))
            for index, name in enumerate(queue_names(count))]


def _handler(cost_s: float) -> Callable[[list[Job]], None]:
    def handle(jobs: list[Job]) -> None:
        time.sleep(cost_s * len(jobs))
    return handle


for _shape in queue_shapes(int(os.environ.get("QB_FLEET_QUEUES", "150"))):
    app.queue(_shape.name, batch_size=_shape.batch_size, priority=_shape.priority,
              max_slots=16)(_handler(_shape.cost_s))
