"""Issue 16 B3: jobs enqueued to a queue no app declares show on the manager at its next
planning round (with their current count), not only at its 60 s broker check."""

from __future__ import annotations

from qcluster.broker.redis_broker import RedisBroker
from qcluster.client import Client
from qcluster.config import load_settings
from qcluster.manager.service import ManagerService
from qcluster.manager.state import ClusterState


def listed(service: ManagerService) -> dict[str, int]:
    return {q.name: q.ready for q in service.state.undeclared}


def test_an_undeclared_queue_shows_at_the_next_round_with_its_count(
    redis_url: str, queue_name: str
) -> None:
    """Fails before: the undeclared queues were read only every BROKER_CHECK_INTERVAL_S."""
    broker = RedisBroker.from_url(redis_url)
    service = ManagerService(ClusterState(load_settings(None)), broker, None)
    try:
        service.round()  # the first round's broker check: the queue does not exist yet
        assert queue_name not in listed(service)
        with Client(redis_url) as client:
            client.enqueue_many(queue_name, [{"n": n} for n in range(3)])
            service.round()
            assert listed(service).get(queue_name) == 3, service.state.undeclared
            client.enqueue(queue_name, {"n": 3})
            service.round()
            assert listed(service).get(queue_name) == 4, service.state.undeclared
            client.purge(queue_name)
            service.round()
            assert queue_name not in listed(service)
    finally:
        broker.delete_queue(queue_name)
        broker.close()
