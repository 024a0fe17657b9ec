"""The views read a queue's last window of history out of the hour its ring holds, for every
queue at every read of the overview and /api/v1/cluster: only the window's points may be
built (building all of them cost seconds per read at 150 queues after an hour)."""

from __future__ import annotations

from typing import Any

import pytest

from qcluster.manager.history import HistoryRing
from qcluster.messages import HistoryPoint


def test_since_builds_only_the_points_in_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    ring = HistoryRing()
    for n in range(1800):  # an hour at a 2 s round
        ring.append(HistoryPoint(at=float(n * 2), backlog=n, slots_planned=1, slots_current=1,
                                 load=0.5, rate_out=1.0), capacity=1816)
    built = []
    construct = HistoryPoint.model_construct

    def counting(*args: Any, **values: Any) -> HistoryPoint:
        built.append(values["at"])
        return construct(*args, **values)

    monkeypatch.setattr(HistoryPoint, "model_construct", counting)
    window = ring.since(3598.0 - 60.0)
    assert [p.at for p in window] == [float(at) for at in range(3538, 3600, 2)]
    assert len(built) == len(window) == 31
