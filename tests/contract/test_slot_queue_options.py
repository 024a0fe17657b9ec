"""A slot tells its broker its queue's policy before it declares the queue: on RabbitMQ a
queue whose policy says ``queue_type = "quorum"`` is declared a quorum queue by the slot
that serves it (the broker URL says nothing about the type)."""

from __future__ import annotations

from qcluster.app import App
from qcluster.broker import open_broker
from qcluster.slot.runtime import SlotRunner
from tests.contract.test_rabbitmq_quorum import queue_types


def test_a_slot_declares_its_queue_with_its_policys_queue_type(
    rabbitmq_url: str, queue_name: str
) -> None:
    app = App()
    app.queue(queue_name, queue_type="quorum", max_attempts=4)(lambda jobs: None)
    broker = open_broker(rabbitmq_url)
    try:
        SlotRunner(app, queue_name, broker, burst=True).step()
        assert queue_types(queue_name).get(queue_name) == "quorum", queue_types(queue_name)
    finally:
        broker.close()
