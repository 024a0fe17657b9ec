"""What the admin pages show, as values: the queue table's order, ages, sizes and the
queue page's charts. Pure (no request, no clock, no I/O); ``router.py`` renders them.
The figures themselves come with the ClusterView the source (the manager) gives."""

from __future__ import annotations

import math
from typing import Any

from qcluster.admin_ui.charts import Series, line_chart
from qcluster.messages import HistoryPoint, QueueView

#: Sortable columns of the queue table: query value -> QueueView attribute.
SORT_KEYS = {
    "name": "name", "priority": "priority", "slots": "slots_current", "avg": "slots_avg",
    "planned": "slots_planned", "load": "load", "backlog": "backlog", "locked": "locked",
    "delayed": "delayed", "dead": "dead", "in": "rate_in", "out": "rate_out",
    "job": "mean_job_seconds",
}


def sort_queues(queues: list[QueueView], key: str, direction: str) -> list[QueueView]:
    """Queues ordered by a column; unknown keys fall back to priority, highest first."""
    attribute = SORT_KEYS.get(key)
    if attribute is None:
        return sorted(queues, key=lambda q: (-q.priority, q.name))

    def value(queue: QueueView) -> Any:
        found = getattr(queue, attribute)
        return math.inf if found is None else found  # an undefined load: work, no slot

    return sorted(queues, key=value, reverse=direction == "desc")


def age(seconds: float) -> str:
    """'4s', '3m 10s', '2h 5m': the age of a report as a person reads it."""
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60}s"
    return f"{seconds // 3600}h {seconds % 3600 // 60}m"


def mib(value: int) -> str:
    return f"{value / (1 << 20):,.0f} MiB"


def history_charts(points: list[HistoryPoint]) -> list[str]:
    """The four charts of the queue page, x in seconds relative to now."""
    now = points[-1].at if points else 0.0

    def line(label: str, color: str, attribute: str, scale: float = 1.0) -> Series:
        return Series(label, color, [(p.at - now, getattr(p, attribute) * scale)
                                     for p in points if getattr(p, attribute) is not None])

    return [
        line_chart("Backlog (ready jobs)", [line("backlog", "#c0392b", "backlog")]),
        line_chart("Slots", [
            line("planned", "#2c7be5", "slots_planned"),
            line("running", "#2e9d58", "slots_current"),
        ]),
        line_chart("Load", [line("load %", "#8e44ad", "load", 100.0)], unit="%"),
        line_chart("Throughput", [line("jobs/s", "#d68910", "rate_out")], unit="/s"),
    ]
