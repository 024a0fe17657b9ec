"""The planner's data built by ``quick_init`` (the simulator builds several per queue per
round): the same constructor and the same frozen objects as ``@dataclass`` makes."""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any

import pytest

from qcluster.manager.planning.arrivals import ArrivalCount
from qcluster.manager.planning.types import (
    Need,
    QueueInput,
    QueuePlan,
    QueueWindow,
    Why,
    quick_init,
)
from qcluster.policy import QueuePolicy

CLASSES = [QueueWindow, QueueInput, QueuePlan, Need, ArrivalCount]


def plain(cls: type) -> Any:
    """The same class as ``@dataclass(frozen=True, slots=True)`` alone builds it."""
    return dataclasses.make_dataclass(
        cls.__name__,
        [(f.name, f.type, dataclasses.field(default=f.default, kw_only=f.kw_only))
         for f in dataclasses.fields(cls)],
        frozen=True, slots=True)


def shape(cls: type) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(cls).parameters.values()]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_the_constructor_takes_what_the_dataclass_one_takes(cls: type) -> None:
    assert shape(cls) == shape(plain(cls))
    assert list(inspect.signature(cls).parameters) == list(
        inspect.signature(vars(cls)["__init__"]).parameters)[1:]


def test_objects_are_the_same_frozen_values() -> None:
    policy = QueuePolicy.model_validate({})
    window = QueueWindow(3, 1.5, backlog=7, recent_margin=0.5)
    assert dataclasses.astuple(window) == (3, 1.5, 0.0, 7, 0.0, 0.0, 0, 0.5)
    why = Why("{} slots", 2)
    plan = QueuePlan("q", 1, 2, 2, 0.5, 0.2, 0.01, why, spare=1, work=0.3, quiet_s=4.0)
    assert (plan.name, plan.planned, plan.spare, plan.work, plan.spread, plan.quiet_s,
            plan.low_rounds, plan.why) == ("q", 2, 1, 0.3, -1.0, 4.0, 0, why)
    need = Need(2, 0.5, "kept", 1, low_peak=1.5)
    assert (need.needed, need.spare, need.low_peak, need.quiet_s) == (2, 1, 1.5, math.inf)
    queue = QueueInput("q", policy, 1, window, previous=plan)
    assert (queue.paused, queue.servable, queue.previous, queue.next_tick_s) == (
        False, True, plan, None)
    assert dataclasses.replace(window, backlog=8).backlog == 8
    assert ArrivalCount(4, 1.0) == ArrivalCount(jobs=4, margin=1.0)
    assert hash(window) == hash(QueueWindow(3, 1.5, backlog=7, recent_margin=0.5))
    with pytest.raises(dataclasses.FrozenInstanceError):
        window.backlog = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        QueuePlan("q", 1, 2, 2, 0.5, 0.2, 0.01, why, 0, 0, 0.3)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Need(2, 0.5)  # type: ignore[call-arg]


def test_fields_it_does_not_build_are_refused() -> None:
    @dataclasses.dataclass(frozen=True, slots=True)
    class Listed:
        items: list[int] = dataclasses.field(default_factory=list)

    with pytest.raises(TypeError, match="plain fields only"):
        quick_init(Listed)
