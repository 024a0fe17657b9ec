"""Celery with its defaults, except that results are ignored (a no-op has none to keep)."""

from __future__ import annotations

import os

from celery import Celery

import bench.ballast  # noqa: F401  (the memory suite's big application)

QUEUE = os.environ.get("QB_QUEUE", "bench")
app = Celery("bench", broker=os.environ.get("QB_BROKER", "redis://127.0.0.1:6379/9"))
app.conf.update(task_ignore_result=True, task_default_queue=QUEUE,
                broker_connection_retry_on_startup=True)


@app.task(name="noop")
def noop(n: int | None = None) -> None:
    """Does nothing: what is measured is the framework and the broker."""
