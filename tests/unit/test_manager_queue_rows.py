"""The overview's queue rows are built once per planning round (QueueRows): a read between two
rounds reuses them; a round, a pause or a queue that appears builds them again at once."""

from __future__ import annotations

from collections.abc import Hashable

import pytest

from qcluster.manager.views import QueueRows
from qcluster.messages import QueueView
from tests.unit.test_manager_service import service
from tests.unit.test_manager_state import POLICIES, make_policy
from tests.unit.test_manager_state import report as host_report


def test_rows_are_built_once_per_round_and_again_after_a_change(
        monkeypatch: pytest.MonkeyPatch) -> None:
    manager, broker, clock = service()
    built: list[Hashable] = []
    keep = QueueRows.keep

    def counting(self: QueueRows, key: Hashable, rows: list[QueueView]) -> None:
        built.append(key)
        keep(self, key, rows)

    monkeypatch.setattr(QueueRows, "keep", counting)
    manager.receive(host_report("a", {"mail": 1}, processed=10))
    manager.cluster_view()
    manager.cluster_view()
    assert len(built) == 2  # before the first round nothing is kept
    manager.round()
    broker.ready["mail"] = 7
    first = manager.cluster_view()
    clock.now += 0.5
    manager.receive(host_report("a", {"mail": 1}, processed=10))
    again = manager.cluster_view()
    assert len(built) == 3 and again.queues == first.queues  # same round: same rows
    assert again.generated_at == clock.now  # the hosts are read fresh
    manager.state.paused.add("mail")
    assert next(q for q in manager.cluster_view().queues if q.name == "mail").paused
    manager.receive(host_report("b", {"mail": 1}, queues={
        **POLICIES, "new": make_policy()}))
    assert "new" in [q.name for q in manager.cluster_view().queues]
    manager.round()
    assert next(q for q in manager.cluster_view().queues if q.name == "mail").backlog == 7
    assert len(built) == 6
