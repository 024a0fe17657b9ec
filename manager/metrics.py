"""The manager's /metrics: per-queue gauges computed from the state at scrape time."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from manager.api import ManagerService


class ManagerCollector:
    def __init__(self, service: ManagerService) -> None:
        self.service = service

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        view = self.service.cluster_view()
        per_queue = {
            "qcluster_queue_backlog": ("Ready jobs.", "backlog"),
            "qcluster_queue_locked": ("Jobs taken and not settled.", "locked"),
            "qcluster_queue_delayed": ("Jobs waiting for their activation time.", "delayed"),
            "qcluster_queue_dead": ("Dead-lettered jobs.", "dead"),
            "qcluster_queue_load_ratio": ("Load over the window (1 = 100%).", "load"),
            "qcluster_queue_slots_planned": ("Slots the manager plans.", "slots_planned"),
            "qcluster_queue_slots_current": ("Slots running now.", "slots_current"),
        }
        for name, (doc, attribute) in per_queue.items():
            family = GaugeMetricFamily(name, doc, labels=["queue"])
            for queue in view.queues:
                value = getattr(queue, attribute)  # None: undefined (a load with no slot)
                family.add_metric([queue.name], math.nan if value is None else float(value))
            yield family
        up = GaugeMetricFamily("qcluster_host_up", "1 while the host reports.", labels=["host"])
        for host in view.hosts:
            up.add_metric([host.name], 1.0 if host.alive else 0.0)
        yield up
        yield GaugeMetricFamily("qcluster_hosts_alive", "Hosts reporting.",
                                value=sum(h.alive for h in view.hosts))
        yield GaugeMetricFamily("qcluster_planning_round_seconds", "Last planning round.",
                                value=getattr(self.service, "last_round_s", 0.0))


def render(service: ManagerService) -> tuple[bytes, str]:
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(ManagerCollector(service))
    return generate_latest(registry), CONTENT_TYPE_LATEST
