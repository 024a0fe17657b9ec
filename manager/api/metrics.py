"""The manager's /metrics: gauges computed from the cluster view at scrape time; their
names and help texts are defined once, in ``qcluster.metrics``."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from qcluster.metrics import MANAGER_GAUGES, MANAGER_QUEUE_GAUGES

if TYPE_CHECKING:
    from qcluster.manager.service import ManagerService


class ManagerCollector:
    def __init__(self, service: ManagerService) -> None:
        self.service = service

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        view = self.service.cluster_view()
        for name, (doc, attribute) in MANAGER_QUEUE_GAUGES.items():
            family = GaugeMetricFamily(name, doc, labels=["queue"])
            for queue in view.queues:
                value = getattr(queue, attribute)  # None: undefined (a load with no slot)
                family.add_metric([queue.name], math.nan if value is None else float(value))
            yield family
        up = GaugeMetricFamily("qcluster_host_up", MANAGER_GAUGES["qcluster_host_up"],
                               labels=["host"])
        for host in view.hosts:
            up.add_metric([host.name], 1.0 if host.alive else 0.0)
        yield up
        yield GaugeMetricFamily("qcluster_hosts_alive", MANAGER_GAUGES["qcluster_hosts_alive"],
                                value=sum(h.alive for h in view.hosts))
        refused = GaugeMetricFamily("qcluster_reports_refused",
                                    MANAGER_GAUGES["qcluster_reports_refused"],
                                    labels=["host", "reason"])
        for refusal in self.service.refused_now():
            refused.add_metric([refusal.host, refusal.reason], 1.0)
        yield refused
        yield GaugeMetricFamily(
            "qcluster_planning_round_seconds", MANAGER_GAUGES["qcluster_planning_round_seconds"],
            value=self.service.last_round_s)


def render(service: ManagerService) -> tuple[bytes, str]:
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(ManagerCollector(service))
    return generate_latest(registry), CONTENT_TYPE_LATEST
