"""Real report JSON from a fleet of hosts that do not exist: what a manager sees from N masters
serving Q queues, built with the masters' own message models (``qcluster.messages``), so
the manager validates and plans them exactly as it does a real master's.

Used to measure the admin page and ``/api/v1/cluster`` at the seed's size (40 hosts x 150
queues, about 3,500 slots) without 3,500 real processes on a 2-core machine
(``python -m tests.browser.measure_fleet``). The e2e test of the page runs real masters.
"""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

from qcluster.messages import (
    BatchCounters,
    HostFacts,
    HostReport,
    QueueCounters,
    SlotInfo,
)
from qcluster.policy import QueuePolicy


def queue_names(count: int) -> list[str]:
    return [f"q{n:03d}" for n in range(count)]


def policies(names: list[str]) -> dict[str, QueuePolicy]:
    """A spread of priorities and sizes: a few big queues, many small ones."""
    return {name: QueuePolicy.model_validate({
        "priority": (n * 7) % 11 - 5, "min_slots": 1 if n % 5 == 0 else 0,
        "max_slots": 40 if n % 10 == 0 else 8, "batch_size": (1, 10, 100)[n % 3]})
        for n, name in enumerate(names)}


def host_report(host: int, names: list[str], slots_per_host: int, *,
                now: float | None = None, interval_s: float = 2.0) -> HostReport:
    """Host ``h{host:02d}``'s report: ``slots_per_host`` busy slots spread over the queues
    (the big queues get more), counters for each queue it runs."""
    now = time.time() if now is None else now
    chosen = [names[(host * 13 + i * 7) % len(names)] for i in range(slots_per_host)]
    infos = [SlotInfo(slot_no=i, pid=10_000 + host * 1000 + i, queue=q, state="busy",
                      started_at=now - 600 - i, jobs_done=i * 10)
             for i, q in enumerate(chosen)]
    running: dict[str, int] = {}
    for q in chosen:
        running[q] = running.get(q, 0) + 1
    counters = {q: QueueCounters(counters=BatchCounters(done=50 * n, batches=n,
                                                        busy_s=interval_s * n * 0.6),
                                 alive_s=interval_s * n) for q, n in running.items()}
    facts = HostFacts(cpus=32, loadavg=(4.0 + host % 5, 4.0, 4.0), mem_total_bytes=64 << 30,
                      mem_available_bytes=(20 + host % 7) << 30,
                      pss_total_bytes=slots_per_host * (18 << 20),
                      avg_slot_pss_bytes=18 << 20)
    return HostReport(host=f"h{host:02d}", sent_at=now, interval_s=interval_s, facts=facts,
                      capacity_slots=slots_per_host + 10, queues=policies(names),
                      slots=infos, counters=counters)


def post_report(manager_url: str, report: HostReport, token: str | None = None) -> Any:
    """POST one report as a master does; returns the manager's reply (the host's row)."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(manager_url + "/api/v1/reports",
                                     data=report.model_dump_json().encode(),
                                     headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())
