"""Celery with its defaults, except that results are ignored (a no-op has none to keep);
``QB_CONFIRM=1`` turns publisher confirms on."""

from __future__ import annotations

import os

from celery import Celery

import bench.ballast  # noqa: F401  (the memory suite's big application)

QUEUE = os.environ.get("QB_QUEUE", "bench")
app = Celery("bench", broker=os.environ.get("QB_BROKER", "redis://127.0.0.1:6379/9"))
app.conf.update(task_ignore_result=True, task_default_queue=QUEUE,
                broker_connection_retry_on_startup=True)
if os.environ.get("QB_CONFIRM") == "1":  # RabbitMQ publisher confirms, as qcluster's Client
    app.conf.broker_transport_options = {"confirm_publish": True}


@app.task(name="noop")
def noop(n: int | None = None) -> None:
    """Does nothing: what is measured is the framework and the broker."""
