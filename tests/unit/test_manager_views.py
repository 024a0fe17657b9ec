"""manager/views.py, pure: the API's and the admin page's figures from a hand-made
snapshot (rates over the held data, averages over the held points, an undefined load,
the fallbacks before the first plan), and a snapshot is a copy."""

from __future__ import annotations

import math

import pytest

from qcluster.broker.base import QueueStats
from qcluster.manager.planning.plan import QueuePlan, Why
from qcluster.manager.state import (
    HostEntry,
    HostSnapshot,
    QueueSnapshot,
    Sample,
    Snapshot,
    rate_out,
)
from qcluster.manager.views import cluster_view, host_view, queue_view
from qcluster.messages import HistoryPoint
from tests.unit.test_manager_state import make_policy, report, state


def queue(**values: object) -> QueueSnapshot:
    fields: dict[str, object] = dict(
        name="mail", policy=make_policy(priority=3, min_slots=1, max_slots=9,
                                       est_job_seconds=0.5),
        stats=QueueStats(ready=40, locked=2, delayed=3, dead=4), plan=None, running=2,
        samples=(), history=(), paused=False,
    )
    fields.update(values)
    return QueueSnapshot(**fields)  # type: ignore[arg-type]


def plan(planned: int, needed: int, load: float = 0.5) -> QueuePlan:
    return QueuePlan("mail", 2, needed, planned, load, 0.2, 0.01, Why("mail: ..."))


def point(at: float, backlog: int, running: int) -> HistoryPoint:
    return HistoryPoint(at=at, backlog=backlog, slots_planned=running,
                        slots_current=running, load=0.5, rate_out=0.0)


def test_before_the_first_plan_the_view_shows_what_runs_and_the_policy_estimate() -> None:
    view = queue_view(queue(), now=100.0)
    assert (view.slots_current, view.slots_planned, view.slots_avg) == (2, 2, 2.0)
    assert view.load == 0.0 and not view.about_to_resize
    assert view.mean_job_seconds == 0.5 and view.rate_out == 0.0 and view.rate_in == 0.0
    assert (view.backlog, view.locked, view.delayed, view.dead) == (40, 2, 3, 4)
    assert (view.priority, view.min_slots, view.max_slots) == (3, 1, 9)


def test_rates_are_over_the_held_data_and_slots_avg_over_the_held_points() -> None:
    # two hosts, 1 s reports: 100 jobs in [8, 10] s -> 50/s; backlog 0 -> 40 over 10 s
    samples = (Sample(9.0, 50, 0.5, 1.0, 1.0, "a"), Sample(10.0, 50, 0.5, 1.0, 1.0, "b"))
    history = (point(0.0, 0, 1), point(5.0, 20, 3))
    view = queue_view(queue(samples=samples, history=history, plan=plan(4, 6)), now=10.0)
    assert view.rate_out == 50.0 == rate_out(samples)
    assert view.rate_in == pytest.approx(54.0)  # 50/s done + 40 more waiting in 10 s
    assert view.slots_avg == 2.0 and view.slots_planned == 4 and view.about_to_resize


def test_an_undefined_load_is_null_and_a_shrinking_backlog_never_reads_negative() -> None:
    history = (point(0.0, 10_000, 0), point(1.0, 10_000, 0))
    view = queue_view(queue(plan=plan(0, 0, load=math.inf), history=history), now=2.0)
    assert view.load is None and view.rate_in == 0.0


def test_host_view_and_cluster_view_keep_the_snapshot_order() -> None:
    entry = HostEntry(report("a", {"mail": 2}, capacity=6), received_at=7.0)
    host = host_view(HostSnapshot("a", entry, alive=False, planned={"mail": 3}))
    assert (host.alive, host.slots, host.planned, host.last_report_at) == (
        False, {"mail": 2}, {"mail": 3}, 7.0)
    assert host.pss_total_bytes == entry.report.facts.pss_total_bytes
    snapshot = Snapshot(now=9.0, queues=(queue(name="a"), queue(name="b")),
                        hosts=(HostSnapshot("a", entry, True, {}),), slot_map={"a": {}},
                        decisions=(), undeclared=(), durability=("no AOF",))
    view = cluster_view(snapshot)
    assert [q.name for q in view.queues] == ["a", "b"] and view.generated_at == 9.0
    assert view.broker_durability == ["no AOF"] and view.slot_map == {"a": {}}


def test_a_snapshot_is_a_copy() -> None:
    s = state()
    s.receive(report("a", {"mail": 1}, processed=10), now=0.0)
    s.plan_round(now=0.5)
    snapshot = s.snapshot(now=0.5)
    before = cluster_view(snapshot)
    for t in range(1, 4):
        s.receive(report("a", {"mail": 3}, processed=99), now=float(t))
        s.plan_round(now=t + 0.5)
    s.paused.add("mail")
    assert cluster_view(snapshot) == before
