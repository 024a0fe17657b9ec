"""Reporting to the manager: a HostReport every few seconds, the reply is this host's row.

Fail-static: when the manager cannot be reached the master keeps its last row and keeps
processing; the outage is logged once, and its end once.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import httpx
import psutil

from qcluster.master.supervisor import Supervisor
from qcluster.messages import (
    Assignment,
    BatchCounters,
    ClusterClaim,
    HostFacts,
    HostReport,
    QueueCounters,
)

logger = logging.getLogger(__name__)
# httpx logs every request at INFO: one line per report (every 2 s) would bury the log.
logging.getLogger("httpx").setLevel(logging.WARNING)


def build_report(sup: Supervisor, interval_s: float, generation: int,
                 cluster: ClusterClaim | None = None) -> HostReport:
    snap = sup.snapshot
    sample = snap.sample
    now = time.time()
    mono_now = time.monotonic()
    counters = sup.counters.take()
    alive: dict[str, float] = {}
    for info in snap.slots:
        lived_s = mono_now - snap.started_mono.get(info.slot_no, mono_now)
        alive[info.queue] = alive.get(info.queue, 0.0) + max(0.0, min(interval_s, lived_s))
    queues = set(counters) | set(alive)
    pss_total = sample.pss_total_bytes if sample else 0
    facts = HostFacts(
        cpus=sample.cpus if sample else float(os.cpu_count() or 1),
        loadavg=os.getloadavg(),
        mem_total_bytes=int(psutil.virtual_memory().total),
        mem_available_bytes=sample.mem_available_bytes if sample else 0,
        pss_total_bytes=pss_total,
        avg_slot_pss_bytes=snap.avg_slot_pss_bytes,
    )
    return HostReport(
        host=sup.host_name, sent_at=now, interval_s=interval_s, facts=facts,
        capacity_slots=snap.capacity_slots,
        queues=dict(sup.reload.code.serving.policies),
        slots=snap.slots,
        counters={q: QueueCounters(counters=counters.get(q, BatchCounters()),
                                   alive_s=alive.get(q, 0.0)) for q in queues},
        generation=generation,
        code=snap.code,
        cluster=cluster,
        periodic=dict(sup.app.periodic_jobs),
        fatal={q: why[:2000] for q, why in snap.fatal.items()},
    )


class Reporter:
    """Runs in a daemon thread next to the supervisor loop."""

    def __init__(self, sup: Supervisor, manager_url: str, interval_s: float, *,
                 token: str | None = None, cluster: ClusterClaim | None = None) -> None:
        self.sup = sup
        self.cluster = cluster
        """The broker this master works on: a manager on another one refuses the reports."""
        self.url = manager_url.rstrip("/") + "/api/v1/reports"
        self.interval_s = interval_s
        self.headers = {"Content-Type": "application/json"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self.generation = 0
        self.reachable = True

    def start(self) -> None:
        threading.Thread(target=self._loop, name="master-reporter", daemon=True).start()

    def _loop(self) -> None:
        with httpx.Client(timeout=5.0) as client:
            while not self.sup.stopping:
                time.sleep(self.interval_s)
                self.report_once(client)

    def report_once(self, client: httpx.Client) -> None:
        report = build_report(self.sup, self.interval_s, self.generation, self.cluster)
        try:
            response = client.post(self.url, content=report.model_dump_json(),
                                   headers=self.headers)
            response.raise_for_status()
            assignment = Assignment.model_validate_json(response.content)
        except (httpx.HTTPError, ValueError) as exc:
            if self.reachable:
                logger.warning("manager %s unreachable (%s): keeping the last slot row%s",
                               self.url, exc, _hint(exc))
            self.reachable = False
            self._give_back(report)
            return
        if not self.reachable:
            logger.info("manager %s reachable again", self.url)
        self.reachable = True
        self.generation = assignment.generation
        self.interval_s = assignment.report_interval_s
        self.sup.set_row(assignment.row)
        self.sup.set_reload_id(assignment.reload_id)

    def _give_back(self, report: HostReport) -> None:
        """Counters of an undelivered report go into the next one."""
        self.sup.counters.give_back({q: c.counters for q, c in report.counters.items()})


def _hint(exc: Exception) -> str:
    if isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code == 401:
        return " (the manager wants its token: set token / QCLUSTER_TOKEN to the manager's)"
    if isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code == 409:
        try:  # the manager works on another broker: its one line says which
            return f": REFUSED: {exc.response.json().get('detail')}"
        except (ValueError, AttributeError):
            return ""
    return ""
