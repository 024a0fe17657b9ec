"""A ClusterSource with fixed numbers and a real broker's dead-letter store, for page tests."""

from __future__ import annotations

import time

from qcluster.broker.base import Broker, DeadJob
from qcluster.messages import (
    ClusterView,
    DecisionView,
    HistoryPoint,
    HostView,
    QueueView,
    UndeclaredQueueView,
)


def queue_view(name: str, **values: object) -> QueueView:
    base: dict[str, object] = dict(
        name=name, priority=0, min_slots=0, max_slots=10, slots_current=1, slots_planned=1,
        slots_avg=1.0, load=0.5, about_to_resize=False, backlog=0, locked=0, delayed=0, dead=0,
        rate_in=0.0, rate_out=0.0, mean_job_seconds=0.01,
    )
    base.update(values)
    return QueueView.model_validate(base)


class FakeSource:
    """Serves ``queues``; dead jobs, requeue and counts of ``dead_queue`` come from ``broker``."""

    def __init__(self, broker: Broker, dead_queue: str, token: str = "s3cret") -> None:
        self.broker = broker
        self.dead_queue = dead_queue
        self.token = token
        now = time.time()
        self.queues = [
            queue_view("mail", priority=5, slots_current=4, slots_planned=4, load=2.4,
                       about_to_resize=True, backlog=12000, rate_in=900.0, rate_out=400.0),
            queue_view("resize", priority=1, slots_current=2, slots_planned=2, load=0.7,
                       backlog=35, rate_in=20.0, rate_out=21.0),
            queue_view(dead_queue, priority=0, load=0.05),
        ]
        self.hosts = [
            HostView(name="host-a", alive=True, capacity_slots=12, slots={"mail": 2, "resize": 1},
                     planned={"mail": 2, "resize": 1}, mem_available_bytes=8 << 30,
                     pss_total_bytes=900 << 20, loadavg=(0.5, 0.4, 0.3), last_report_at=now - 2),
            HostView(name="host-b", alive=False, capacity_slots=8, slots={"mail": 2},
                     planned={}, mem_available_bytes=4 << 30, pss_total_bytes=500 << 20,
                     loadavg=(1.5, 1.2, 1.0), last_report_at=now - 120),
        ]
        self.decisions = [DecisionView.model_validate(dict(
            at=now - 5, queue="mail", reason="mail: load 240% > 130% -> 4 -> 9 slots",
            **{"from": 4, "to": 9}))]
        self.undeclared: list[UndeclaredQueueView] = []
        self.durability: list[str] = []

    def cluster_view(self) -> ClusterView:
        dead = self.broker.stats(self.dead_queue).dead
        queues = [q.model_copy(update={"dead": dead}) if q.name == self.dead_queue else q
                  for q in self.queues]
        slot_map = {h.name: dict(h.planned) for h in self.hosts}
        return ClusterView(generated_at=time.time(), queues=queues, hosts=self.hosts,
                           slot_map=slot_map, decisions=self.decisions,
                           undeclared_queues=self.undeclared, broker_durability=self.durability)

    def queue_history(self, queue: str) -> list[HistoryPoint]:
        now = time.time()
        return [HistoryPoint(at=now - 60 * (30 - i), backlog=i * 100, slots_planned=i // 5,
                             slots_current=i // 6, load=i / 10, rate_out=i * 3.0)
                for i in range(31)]

    def dead_jobs(self, queue: str, limit: int = 50) -> list[DeadJob]:
        return self.broker.dead_jobs(queue, limit=limit)

    def requeue_dead(self, queue: str) -> int:
        return self.broker.requeue_dead(queue)

    def check_token(self, token: str | None) -> bool:
        return bool(self.token) and token == self.token
