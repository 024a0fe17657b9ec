"""What the admin pages show, as values: the queue table's order, ages, sizes and the
queue page's charts. Pure (no request, no clock, no I/O); ``router.py`` renders them.
The figures themselves come with the ClusterView the source (the manager) gives."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from qcluster.admin_ui.charts import Series, line_chart
from qcluster.messages import HistoryPoint, HostView, QueueView

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


# --- the slot map at fleet size ----------------------------------------------------------

#: Up to this many queues the map is a host x queue grid; above, each host's row lists the
#: queues that matter first and a filter brings chosen queues back as columns.
GRID_MAX_QUEUES = 12
#: Queues listed in a host's row when the map is not a grid (the rest: the host's page).
CELLS_SHOWN = 6
#: Why a host is shown first: the lower, the sooner.
HOST_ORDER = {"dead": 0, "failed": 1, "converging": 2, "reloading": 3, "drained": 4, "ok": 5}


@dataclass(frozen=True)
class Cell:
    """One queue on one host: slots planned and running."""

    queue: str
    planned: int
    running: int

    @property
    def converging(self) -> bool:
        return self.planned != self.running


@dataclass(frozen=True)
class HostRow:
    """A host in the slot map: its state, totals and its queues, converging first."""

    host: HostView
    state: str
    planned: int
    running: int
    cells: list[Cell]

    @property
    def converging(self) -> int:
        """Queues whose running slots differ from the plan; none on a dead host, whose
        slots are its last report's and are planned elsewhere, not catching up."""
        if self.state == "dead":
            return 0
        return sum(cell.converging for cell in self.cells)

    def cell(self, queue: str) -> Cell:
        return next((c for c in self.cells if c.queue == queue), Cell(queue, 0, 0))


def host_cells(host: HostView) -> list[Cell]:
    """The host's queues with a slot planned or running: converging first, then the
    most planned, then by name."""
    cells = [Cell(q, host.planned.get(q, 0), host.slots.get(q, 0))
             for q in set(host.planned) | set(host.slots)
             if host.planned.get(q, 0) or host.slots.get(q, 0)]
    return sorted(cells, key=lambda c: (not c.converging, -max(c.planned, c.running), c.queue))


def host_state(host: HostView, drained: bool, cells: list[Cell]) -> str:
    if drained:
        return "drained"
    if not host.alive:
        return "dead"
    if host.code.state == "failed":
        return "failed"
    if any(c.converging for c in cells):
        return "converging"
    return "reloading" if host.code.state != "idle" else "ok"


def host_rows(hosts: list[HostView], drained: set[str] | dict[str, Any]) -> list[HostRow]:
    """The slot map's rows, the hosts that need a look first (dead, a failed reload,
    converging, reloading, drained), then by name."""
    rows = []
    for host in hosts:
        cells = host_cells(host)
        rows.append(HostRow(host, host_state(host, host.name in drained, cells),
                            sum(host.planned.values()), sum(host.slots.values()), cells))
    return sorted(rows, key=lambda r: (HOST_ORDER[r.state], r.host.name))


def running_total(rows: list[HostRow]) -> int:
    """The slots running now: a dead host's are only what it last reported."""
    return sum(row.running for row in rows if row.state != "dead")


def matching(names: list[str], text: str) -> list[str]:
    """The names containing ``text`` (case-insensitive); all of them when it is empty."""
    wanted = text.strip().lower()
    return [n for n in names if wanted in n.lower()] if wanted else list(names)


def state_counts(rows: list[HostRow]) -> dict[str, int]:
    """How many hosts are in each state, in the map's order, zeros left out."""
    counts = {state: 0 for state in HOST_ORDER}
    for row in rows:
        counts[row.state] += 1
    return {state: n for state, n in counts.items() if n}
