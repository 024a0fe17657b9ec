"""The planner's data: what a round tells it per queue (:class:`QueueInput`, its
:class:`QueueWindow`), what it answers (:class:`QueuePlan`, with its :class:`Why`) and the
memory a plan carries to the next round (:class:`Streak`). Pure, frozen, slotted: built
for every queue every round (``manager/planning/plan.py`` decides)."""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields
from typing import Any, TypeVar

from qcluster.policy import QueuePolicy

_Frozen = TypeVar("_Frozen", bound=type)


def quick_init(cls: _Frozen) -> _Frozen:
    """Give a frozen, slotted dataclass an ``__init__`` that sets each slot through its
    descriptor, bound once, instead of ``object.__setattr__(self, name, value)``: the same
    signature, defaults and object, built in about half the time (the planner builds
    several of these per queue per round). Apply it above ``@dataclass``."""
    params: list[str] = []
    kw_only: list[str] = []
    body: list[str] = []
    names: dict[str, Any] = {"__object_new": object.__new__}
    for f in fields(cls):
        if f.default_factory is not MISSING or not f.init:  # not needed here: not handled
            raise TypeError(f"{cls.__name__}.{f.name}: quick_init handles plain fields only")
        names[f"__set_{f.name}"] = getattr(cls, f.name).__set__
        param = f.name
        if f.default is not MISSING:
            names[f"__default_{f.name}"] = f.default
            param += f"=__default_{f.name}"
        (kw_only if f.kw_only else params).append(param)
        body.append(f"    __set_{f.name}(self, {f.name})")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__}: quick_init does not call __post_init__")
    signature = ", ".join(["self", *params, *(["*", *kw_only] if kw_only else [])])
    source = f"def __init__({signature}) -> None:\n" + "\n".join(body or ["    pass"])
    exec(source, names)  # as dataclasses builds its own __init__
    init = names["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__annotations__ = {f.name: f.type for f in fields(cls)} | {"return": None}
    cls.__init__ = init  # type: ignore[misc]
    return cls


@quick_init
@dataclass(frozen=True, slots=True)
class QueueWindow:
    """A queue's statistics over the planning window, summed over live hosts."""

    processed: int = 0
    busy_s: float = 0.0
    alive_s: float = 0.0
    backlog: int = 0
    span_s: float = 0.0
    """Seconds the sums cover (0: unknown)."""
    recent_s: float = 0.0
    """Seconds since the previous planning round that ``recent_arrived`` covers (0: none)."""
    recent_arrived: int = 0
    """Jobs enqueued in those seconds, as the caller counts them
    (``manager/planning/arrivals.py``)."""
    recent_margin: float = 0.0
    """Jobs the count may be off by (settled jobs the reports owed at either end: counted
    a round late): a count within this margin of the estimate is no change of rate."""


class Why:
    """A reason, formatted only when read: a plan is made every round for every queue,
    its reason is read when the plan changed or a person looks."""

    __slots__ = ("args", "template")

    def __init__(self, template: str, *args: object) -> None:
        self.template, self.args = template, args

    def __str__(self) -> str:
        return self.template.format(*self.args)

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


@dataclass(frozen=True, kw_only=True, slots=True)
class Streak:
    """The planner's memory between rounds, beyond the plan itself: the work estimate and
    the hold counters. A :class:`Need` computes them, its :class:`QueuePlan` carries them to
    the next round (``QueueInput.previous``)."""

    work: float = 0.0
    """Slot-seconds of work arriving per second, as this round estimated it."""
    spread: float = -1.0
    """How far a round's reading of ``work`` falls from the estimate before it: the mean
    square, smoothed across rounds, in (slot-seconds per second) squared (-1: none yet).
    The counts are noisier than Poisson (jobs settled between a report and the round are
    counted a round late): the planner's edges leave room for the noise measured."""
    low_rounds: int = 0
    """Rounds in a row the queue wanted fewer slots than planned (scale-down hold)."""
    low_peak: float = 0.0
    """The most slots wanted during those rounds (but the first ones): sets the release."""
    low_jobs: int = 0
    """Jobs counted during those rounds (a release needs enough of them to trust)."""
    high_rounds: int = 0
    """Rounds in a row the queue wanted more (not far more) slots than planned."""
    high_floor: int = 0
    """The fewest slots wanted during those rounds: what a rise goes up to."""
    quiet_s: float = math.inf
    """Seconds since jobs last arrived or waited (inf: none seen): within the policy's
    ``idle_s`` the queue keeps a warm slot."""


STREAK_FIELDS = tuple(f.name for f in fields(Streak))


@quick_init
@dataclass(frozen=True, slots=True)
class QueuePlan(Streak):
    name: str
    current: int
    needed: int
    """What the queue asks for, before the cluster's capacity is shared out."""
    planned: int
    load: float
    band: float
    mean_job_s: float
    why: Why
    backlog: int = 0
    """Ready jobs at this round."""
    spare: int = 0
    """Of ``needed``, the slots a hold or a warm slot keeps while nothing waits: any
    queue's real need ranks before them when capacity is short."""

    @property
    def reason(self) -> str:
        """Why: the numbers the decision used, e.g. ``mail: load 240%, ... 4 -> 9 slots``."""
        return str(self.why)


@quick_init
@dataclass(frozen=True, slots=True)
class QueueInput:
    name: str
    policy: QueuePolicy
    current: int
    """Slots running now (lags the plan while masters fork and drain)."""
    window: QueueWindow
    paused: bool = False
    servable: bool = True
    """False when no live host's application declares the queue: no slot could run it."""
    previous: QueuePlan | None = None
    """This queue's plan of the previous round (None on the first round)."""
    next_tick_s: float | None = None
    """Seconds until the next tick of a periodic job enqueued on this queue (None: none)."""


@quick_init
@dataclass(frozen=True, slots=True)
class Need(Streak):
    """One queue's need, with the numbers the decision used."""

    needed: int
    load: float
    why: Why | str
    spare: int = 0
    """Of ``needed``, the slots a hold keeps while nothing came and nothing waits (beyond
    ``min_slots``): when capacity is short they go to the queues that wait, of the same
    priority or a higher one (never a lower one)."""
