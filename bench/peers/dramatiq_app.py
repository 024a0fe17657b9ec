"""Dramatiq with its default middleware; prefetch comes from ``dramatiq_queue_prefetch``,
``QB_CONFIRM=1`` turns RabbitMQ publisher confirms on."""

from __future__ import annotations

import os

import dramatiq

import bench.ballast  # noqa: F401  (the memory suite's big application)

QUEUE = os.environ.get("QB_QUEUE", "bench")
URL = os.environ.get("QB_BROKER", "redis://127.0.0.1:6379/9")

if URL.startswith("redis"):
    from dramatiq.brokers.redis import RedisBroker

    broker: dramatiq.Broker = RedisBroker(url=URL)
else:
    from dramatiq.brokers.rabbitmq import RabbitmqBroker

    # kombu spells the default vhost "//", pika wants it quoted
    broker = RabbitmqBroker(url=URL[:-2] + "/%2F" if URL.endswith("//") else URL,
                            confirm_delivery=os.environ.get("QB_CONFIRM") == "1")
dramatiq.set_broker(broker)


@dramatiq.actor(queue_name=QUEUE, max_retries=0)
def noop(n: int | None = None) -> None:
    """Does nothing: what is measured is the framework and the broker."""
