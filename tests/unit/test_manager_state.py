"""The manager's state, replayed with time as an argument: expiry, re-planning, policies
from qcluster.toml over the code defaults, the decision ring, drain, restart."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qcluster.broker.base import QueueStats
from qcluster.config import load_settings
from qcluster.manager.state import ClusterState
from qcluster.manager.views import cluster_view
from qcluster.messages import (
    BatchCounters,
    ClusterView,
    HostFacts,
    HostReport,
    QueueCounters,
    SlotInfo,
)
from qcluster.policy import QueuePolicy


def make_policy(**fields: Any) -> QueuePolicy:
    """A validated policy (keywords checked at run time, as in qcluster.toml)."""
    return QueuePolicy.model_validate(fields)


FACTS = HostFacts(cpus=2, loadavg=(0.1, 0.1, 0.1), mem_total_bytes=8 << 30,
                  mem_available_bytes=4 << 30, pss_total_bytes=1 << 28,
                  avg_slot_pss_bytes=1 << 24)
POLICIES = {"mail": make_policy(max_slots=8, priority=5), "noop": make_policy(min_slots=1)}


def report(host: str, slots: dict[str, int], *, capacity: int = 6, busy: float = 0.0,
           processed: int = 0, queues: dict[str, QueuePolicy] | None = None) -> HostReport:
    infos = [SlotInfo(slot_no=i, pid=1000 + i, queue=q, state="busy", started_at=0.0)
             for i, q in enumerate(q for q, n in slots.items() for _ in range(n))]
    counters = {q: QueueCounters(counters=BatchCounters(done=processed, busy_s=busy),
                                 alive_s=1.0 * n) for q, n in slots.items()}
    return HostReport(host=host, sent_at=0.0, interval_s=1.0, facts=FACTS,
                      capacity_slots=capacity, queues=queues or POLICIES, slots=infos,
                      counters=counters)


def state(toml: str = "", window_s: float = 10.0) -> ClusterState:
    """A fresh manager state configured by a real qcluster.toml."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "qcluster.toml"
        path.write_text(f"[manager]\ninterval_s = 1.0\nwindow_s = {window_s}\n"
                        "decisions_kept = 10\n" + toml)
        return ClusterState(load_settings(path))


def view(s: ClusterState, now: float) -> ClusterView:
    """What /api/v1/cluster shows at ``now``."""
    return cluster_view(s.snapshot(now))


def test_first_reply_keeps_what_the_host_runs_then_the_plan() -> None:
    s = state()
    assert s.receive(report("a", {"mail": 2}), now=0.0).row == {"mail": 2}
    s.set_stats({"mail": QueueStats(ready=5000)})
    s.plan_round(now=0.5)
    row = s.receive(report("a", {"mail": 2}), now=1.0).row
    assert row["mail"] > 2 and row["noop"] == 1


def test_dead_host_expires_and_its_slots_move_in_one_round() -> None:
    s = state()
    s.receive(report("a", {"mail": 3}), now=0.0)
    s.receive(report("b", {"mail": 3}), now=0.0)
    s.set_stats({"mail": QueueStats(ready=100_000)})
    s.plan_round(now=0.1)
    assert set(s.slot_map) == {"a", "b"}
    for t in range(1, 8):  # a keeps reporting, b has gone silent
        s.receive(report("a", s.slot_map.get("a", {})), now=float(t))
    s.plan_round(now=7.5)
    assert set(s.slot_map) == {"a"}
    assert sum(s.slot_map["a"].values()) == 6  # all of a's capacity, none lost on b
    hosts = {h.name: h.alive for h in view(s, 7.5).hosts}
    assert hosts == {"a": True, "b": False}


def test_toml_overrides_code_policy_and_a_toml_only_queue_is_planned_at_zero() -> None:
    s = state("[queues.mail]\nmax_slots = 2\n[queues.parked]\nmin_slots = 3\n")
    s.receive(report("a", {}), now=0.0)
    s.set_stats({"mail": QueueStats(ready=100_000)})
    s.plan_round(now=0.1)
    assert s.plans["mail"].planned == 2
    assert s.plans["parked"].planned == 0  # no master can run it
    assert "served by no live host" in s.plans["parked"].reason
    assert "parked" not in s.slot_map["a"]
    priorities = {q.name: q.priority for q in view(s, 0.1).queues}
    assert priorities["mail"] == 5  # the code's priority survives the override


def test_a_queue_only_goes_to_hosts_that_declare_it() -> None:
    s = state()
    s.receive(report("a", {}, queues={"mail": POLICIES["mail"]}), now=0.0)
    s.receive(report("b", {}, queues={"noop": POLICIES["noop"]}), now=0.0)
    s.set_stats({"mail": QueueStats(ready=100_000)})
    s.plan_round(now=0.1)
    assert set(s.slot_map["a"]) == {"mail"} and set(s.slot_map["b"]) == {"noop"}


def test_decision_log_is_a_bounded_ring_with_numbers() -> None:
    s = state()
    for t in range(30):
        s.receive(report("a", s.slot_map.get("a", {"mail": 1})), now=float(t))
        s.set_stats({"mail": QueueStats(ready=100_000)})
        # A move every round (the planner no longer flaps on a backlog that comes and goes).
        (s.paused.add if t % 2 else s.paused.discard)("mail")
        s.plan_round(now=t + 0.5)
    decisions = view(s, 30.0).decisions
    assert len(decisions) == 10
    assert decisions[0].at >= decisions[-1].at  # newest first
    for d in decisions:
        assert d.reason.startswith(f"{d.queue}: ") and f"{d.from_slots} -> {d.to_slots}" in d.reason
    dumped = view(s, 30.0).model_dump(by_alias=True)["decisions"][0]
    assert {"from", "to", "at", "queue", "reason"} <= set(dumped)


def test_drained_host_is_given_an_empty_row() -> None:
    s = state()
    s.receive(report("a", {"mail": 2}), now=0.0)
    s.receive(report("b", {"mail": 2}), now=0.0)
    s.drained.add("b")
    s.plan_round(now=0.1)
    assert s.receive(report("b", {"mail": 2}), now=0.5).row == {}
    assert "b" not in s.slot_map


def test_restarted_manager_rebuilds_the_current_map_from_reports() -> None:
    first = state()
    first.receive(report("a", {"mail": 2, "noop": 1}), now=0.0)
    first.plan_round(now=0.1)
    restarted = state()
    row = restarted.receive(report("a", first.slot_map["a"]), now=5.0).row
    assert row == first.slot_map["a"]
    shown = view(restarted, 5.0)
    assert {h.name: h.slots for h in shown.hosts} == {"a": first.slot_map["a"]}


def test_history_records_a_point_per_round() -> None:
    s = state()
    for t in range(5):
        s.receive(report("a", {"noop": 1}), now=float(t))
        s.plan_round(now=t + 0.5)
    points = s.history("noop")
    assert len(points) == 5 and points[-1].slots_planned == 1


def test_rate_out_is_the_flat_rate_from_the_first_seconds() -> None:
    """A flat 50 jobs/s for 10 s of a 60 s window reads 50/s, not a ramp from 8/s."""
    s = state(window_s=60.0)
    for t in range(1, 11):  # one report per second, 50 jobs done in each
        s.receive(report("a", {"resize": 1}, processed=50, busy=0.5,
                         queues={"resize": make_policy()}), now=float(t))
        s.plan_round(now=t + 0.5)
    (queue,) = [q for q in view(s, 10.5).queues if q.name == "resize"]
    assert queue.rate_out == 50.0 and queue.rate_in == 50.0
    assert [p.rate_out for p in s.history("resize")] == [50.0] * 10


def test_load_with_work_waiting_and_no_slot_is_undefined_not_a_clipped_number() -> None:
    """The console showed 'load 9999%': infinity clipped to 99.99. The views say null."""
    s = state()
    s.receive(report("a", {}, queues={"resize": make_policy(max_slots=0)}), now=0.0)
    s.set_stats({"resize": QueueStats(ready=500)})
    s.plan_round(now=0.5)
    (queue,) = view(s, 0.5).queues
    assert queue.load is None and s.history("resize")[-1].load is None
    assert '"load":null' in view(s, 0.5).model_dump_json()


@settings(max_examples=60, deadline=None)
@given(per_s=st.integers(0, 5_000), interval_s=st.sampled_from([0.5, 1.0, 2.0, 5.0]),
       reports=st.integers(1, 80))
def test_a_flat_rate_reads_flat_at_any_age_of_the_window(per_s: int, interval_s: float,
                                                          reports: int) -> None:
    s = state(window_s=60.0)
    for k in range(1, reports + 1):
        body = report("a", {"resize": 1}, processed=round(per_s * interval_s),
                      queues={"resize": make_policy()})
        s.receive(body.model_copy(update={"interval_s": interval_s}), now=k * interval_s)
    (queue,) = view(s, reports * interval_s).queues
    assert queue.rate_out == pytest.approx(round(per_s * interval_s) / interval_s)
