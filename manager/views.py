"""What ``/api/v1/cluster``, ``/metrics`` and the admin page show, built from a
:class:`~qcluster.manager.state.Snapshot`: pure (no clock, no lock, no I/O).

Rates are computed over the data the manager holds, not over a full window it may not
have yet (docs/manager.md, "Rates and load in the views").
"""

from __future__ import annotations

from collections.abc import Hashable

from qcluster.manager.history import column
from qcluster.manager.state import (
    ClusterState,
    HostSnapshot,
    QueueSnapshot,
    Snapshot,
    defined,
    rate_out,
    running_row,
)
from qcluster.messages import ClusterView, HostView, QueueView


def cluster_view(snapshot: Snapshot, queues: list[QueueView] | None = None) -> ClusterView:
    """Queues and hosts by name, the slot map, decisions newest first, broker warnings;
    ``queues``: the queue rows already built (else built from the snapshot's queues)."""
    return ClusterView(
        generated_at=snapshot.now,
        queues=queues if queues is not None else queue_views(snapshot),
        hosts=[host_view(host) for host in snapshot.hosts],
        slot_map={host: dict(row) for host, row in snapshot.slot_map.items()},
        decisions=list(snapshot.decisions),
        undeclared_queues=list(snapshot.undeclared),
        broker_durability=list(snapshot.durability),
    )


def queue_views(snapshot: Snapshot) -> list[QueueView]:
    return [queue_view(queue, snapshot.now) for queue in snapshot.queues]


class QueueRows:
    """The queue rows, built once per planning round and kept until the next.

    Building them reads every report's counters in the window and the queue's history:
    at 40 hosts x 150 queues that is about 100,000 samples and most of the cost of
    ``/api/v1/cluster`` and of the overview, paid again by every reader between two
    rounds. The rows change with the round (the broker's counts, the plan, the history);
    between rounds only the rate and the running count drift, by one round at most. A
    pause or resume, or a queue that appears or goes, builds them again at once.
    """

    def __init__(self) -> None:
        self._key: Hashable = None
        self._rows: list[QueueView] = []

    def held(self, key: Hashable) -> list[QueueView] | None:
        """The rows for ``key`` (None: build them, then :meth:`keep`)."""
        return self._rows if key is not None and key == self._key else None

    def keep(self, key: Hashable, rows: list[QueueView]) -> None:
        self._key, self._rows = key, rows


def queue_rows_key(state: ClusterState, now: float) -> Hashable:
    """What the cached rows depend on beside the round; None before the first round
    (nothing is cached until the manager plans)."""
    if not state.rounds:
        return None
    return (state.rounds, frozenset(state.paused), frozenset(state.policies()))


def queue_view(queue: QueueSnapshot, now: float) -> QueueView:
    """One row of the queue table.

    ``slots_avg`` is the mean running count over the held history points (the running
    count before the first); ``rate_in`` is ``rate_out`` plus the backlog's change over them.
    """
    stats, queue_plan = queue.stats, queue.plan
    # The columns, not the points: building 30 points for each of 150 queues cost more
    # than the rest of the rows.
    current, at = column(queue.history, "slots_current"), column(queue.history, "at")
    avg = sum(current) / len(current) if current else float(queue.running)
    out = rate_out(queue.samples)
    first_backlog = int(column(queue.history, "backlog")[0]) if at else stats.ready
    span = (now - at[0]) if len(at) > 1 else 0.0
    rate_in = out + ((stats.ready - first_backlog) / span if span > 0 else 0.0)
    return QueueView(
        name=queue.name, priority=queue.policy.priority, min_slots=queue.policy.min_slots,
        max_slots=queue.policy.max_slots, slots_current=queue.running,
        slots_planned=queue_plan.planned if queue_plan else queue.running, slots_avg=avg,
        load=defined(queue_plan.load) if queue_plan else 0.0,
        about_to_resize=queue_plan is not None and queue_plan.needed != queue.running,
        backlog=stats.ready, locked=stats.locked, delayed=stats.delayed, dead=stats.dead,
        rate_in=max(0.0, rate_in), rate_out=out,
        mean_job_seconds=(queue_plan.mean_job_s if queue_plan
                          else queue.policy.est_job_seconds),
        paused=queue.paused,
    )


def host_view(host: HostSnapshot) -> HostView:
    report = host.entry.report
    return HostView(
        name=host.name, alive=host.alive, capacity_slots=report.capacity_slots,
        slots=running_row(report), planned=dict(host.planned),
        mem_available_bytes=report.facts.mem_available_bytes,
        pss_total_bytes=report.facts.pss_total_bytes, loadavg=report.facts.loadavg,
        last_report_at=host.entry.received_at, code=report.code, fatal=dict(report.fatal),
    )
