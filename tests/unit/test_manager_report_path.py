"""A master's report is answered while the manager computes: the planning round reads a
copy of the state taken under the lock and counts outside it, and the views copy the
history's numbers under the lock and build from them after. At 40 masters x 150 queues a
round's reads held the lock for tens of milliseconds and a view's for hundreds, and every
report arriving meanwhile waited (bench/fleet.py measures it)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from qcluster.manager import state as state_module
from qcluster.manager.state import ClusterState
from qcluster.messages import Assignment, HistoryPoint
from tests.unit.test_manager_service import service
from tests.unit.test_manager_state import report as host_report

#: How long a report may take before the test calls it blocked (it takes microseconds).
BLOCKED_S = 10.0


def test_a_report_is_answered_while_a_round_computes_its_input(
        monkeypatch: pytest.MonkeyPatch) -> None:
    manager, broker, _ = service()
    broker.ready["mail"] = 5000
    manager.receive(host_report("a", {"mail": 2}))
    computing, release = threading.Event(), threading.Event()
    window = ClusterState.window

    def slow_window(self: ClusterState, queue: str, now: float) -> Any:
        if threading.current_thread().name == "round":
            computing.set()
            release.wait(60)  # the round's input takes as long as the test wants
        return window(self, queue, now)

    monkeypatch.setattr(ClusterState, "window", slow_window)
    planner = threading.Thread(target=manager.round, name="round", daemon=True)
    planner.start()
    assert computing.wait(60)
    replies: list[Assignment] = []
    reporter = threading.Thread(
        target=lambda: replies.append(manager.receive(host_report("b", {"mail": 1}))),
        daemon=True)
    reporter.start()
    reporter.join(BLOCKED_S)
    answered_during_the_round = bool(replies)
    release.set()
    planner.join(60)
    reporter.join(60)
    assert answered_during_the_round
    assert manager.state.rounds == 1 and "b" in manager.state.hosts


def test_neither_a_view_nor_a_round_counts_under_the_lock(
        monkeypatch: pytest.MonkeyPatch) -> None:
    manager, broker, clock = service()
    broker.ready["mail"] = 5000
    for _ in range(3):
        manager.receive(host_report("a", {"mail": 2}, processed=5, busy=0.5))
        manager.round()
        clock.now += 1
    under_lock: list[str] = []
    construct, rate_out = HistoryPoint.model_construct, state_module.rate_out

    def building(*args: Any, **values: Any) -> HistoryPoint:
        if manager.lock._is_owned():  # type: ignore[attr-defined]
            under_lock.append("a history point built")
        return construct(*args, **values)

    def counting(samples: Any) -> float:
        if manager.lock._is_owned():  # type: ignore[attr-defined]
            under_lock.append("a rate counted")
        return rate_out(samples)

    monkeypatch.setattr(HistoryPoint, "model_construct", building)
    monkeypatch.setattr(state_module, "rate_out", counting)
    view = manager.cluster_view()
    manager.round()
    assert under_lock == []
    mail = next(q for q in view.queues if q.name == "mail")
    assert mail.slots_avg > 0 and mail.rate_out > 0  # the rows still read the history
    assert [p.rate_out > 0 for p in manager.queue_history("mail")] == [True] * 4


def test_the_event_loop_never_waits_for_the_lock() -> None:
    """The route answers on the event loop when the lock is free; when another thread
    holds it, nothing is stored and the route hands the report to a pool thread."""
    manager, _, _ = service()
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with manager.lock:
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(60)
    assert manager.try_receive(host_report("a", {"mail": 1})) is None
    assert "a" not in manager.state.hosts
    release.set()
    holder.join(60)
    reply = manager.try_receive(host_report("a", {"mail": 1}))
    assert reply is not None and reply.row == {"mail": 1} and "a" in manager.state.hosts
