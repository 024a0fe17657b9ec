"""The simulation's state: hosts and their slots, each queue's model and figures, and a
policy's run as ``figures.py`` reads it. Plain data; ``engine.py`` moves it."""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from qcluster.manager.planning.arrivals import ArrivalLedger
from qcluster.manager.simulator.arrivals import Arrivals, JobTimes
from qcluster.manager.simulator.trace import Trace
from qcluster.policy import QueuePolicy


@dataclass
class HostSlots:
    active: int = 0
    starting: int = 0
    draining: int = 0
    cancelled: int = 0
    """Starting slots stopped before they were ready: their 'ready' events are void."""


@dataclass
class Host:
    name: str
    capacity: int
    serves: frozenset[str] | None
    alive: bool = True
    died_at: float = -math.inf
    epoch: int = 0
    slots: dict[str, HostSlots] = field(default_factory=dict)
    row: dict[str, int] = field(default_factory=dict)

    used: int = 0
    """Slots taking capacity: active, starting and draining."""


@dataclass
class Series:
    """A queue's chart lines, one point per round or per chunk of rounds."""

    t: list[float] = field(default_factory=list)
    backlog: list[int] = field(default_factory=list)
    slots: list[float] = field(default_factory=list)
    planned: list[int] = field(default_factory=list)
    wait: list[float] = field(default_factory=list)


@dataclass(kw_only=True)
class QueueFigures:
    """What a queue's run is judged on (``figures.py``): counted as it runs, read after."""

    waits: Counter[int] = field(default_factory=Counter)
    """Jobs started per wait, in steps."""
    max_backlog: int = 0
    slot_seconds: float = 0.0
    busy_seconds: float = 0.0
    """Slot-seconds spent running jobs (the rest of ``slot_seconds`` is slack)."""
    starts: int = 0
    stops: int = 0
    move_times: list[float] = field(default_factory=list)
    """When each slot was started or stopped (churn over time)."""
    plan_moves: list[tuple[float, int, int]] = field(default_factory=list)
    """(when, from, to) of each change of the plan."""
    over_target_s: float = 0.0
    over_target_at: list[float] = field(default_factory=list)
    bursts: list[float] = field(default_factory=list)
    burst_from: float | None = None
    series: Series = field(default_factory=Series)
    chunk: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0, 0])
    """The chart's current chunk of rounds: max backlog, slots summed, max planned, max
    wait, rounds."""


@dataclass
class QueueSim(QueueFigures):
    """One queue in the simulation: its jobs, slots and what the manager sees of them (the
    model), with its figures (:class:`QueueFigures`)."""

    name: str
    policy: QueuePolicy
    arrivals: Arrivals
    job_times: JobTimes
    buckets: deque[list[Any]] = field(default_factory=deque)
    backlog: int = 0
    assigned: float = 0.0
    done_work: float = 0.0
    inflight: deque[list[Any]] = field(default_factory=deque)
    """[work done by which they are settled, jobs]: batches taken and not settled, in the
    order taken (a take's batches in at most two entries: all but its last, then its last).
    The first entry's batches settle one by one as the work passes their even shares of
    it (``settled_work`` to its end), not all at its end."""
    taken: deque[list[Any]] = field(default_factory=deque)
    """Beside each entry of ``inflight``: [its batches, when taken, [[enqueued at, jobs],
    ...]] (where its jobs came from, for a dead host's redelivery)."""
    settled_work: float = 0.0
    """The work by which the first entry of ``inflight`` began: its batches are worked
    through from here to its end, and settle one by one as they are."""
    held_batches: int = 0
    """Batches taken and not settled: each holds a slot (the sum of ``taken``'s)."""
    batch_cost_s: float = 0.0
    """A batch's cost beyond its jobs' handler time (``QueueSpec.batch_cost_s``)."""
    handler_share: float = 1.0
    """The share of the latest take's work spent in the handler (what masters report as
    busy; a batch's take and settle are not)."""
    redelivery: deque[list[Any]] = field(default_factory=deque)
    """[when, [[enqueued at, jobs], ...]]: jobs a dead host held, back in the queue (ahead
    of the others, as enqueued) when their locks expire."""
    locked_lost: int = 0
    """Jobs a dead host held whose locks have not expired: in the broker, not ready."""
    redelivered: int = 0
    """Jobs redelivered after their host died (each time)."""
    arrived: int = 0
    started: int = 0
    finished: int = 0
    active: int = 0
    starting: int = 0
    draining: int = 0
    """Stopped slots finishing what they started (on live hosts)."""
    existing: int = 0
    """Slots that take capacity: active, starting and draining, on live hosts."""
    planned: int = -1
    """The plan of the latest round (-1: none yet)."""
    # per round, for the manager's window
    round_processed: int = 0
    round_busy: float = 0.0
    round_alive: float = 0.0
    window: deque[tuple[int, float, float]] = field(default_factory=deque)
    settled: deque[int] = field(default_factory=deque)
    """Jobs finished by each recent step's end (``Simulation.settled_at`` says when), for
    the reports' lag."""
    ledger: ArrivalLedger = field(default_factory=ArrivalLedger)
    win_processed: int = 0
    win_busy: float = 0.0
    win_alive: float = 0.0

    def oldest_wait(self, now: float) -> float:
        return now - self.buckets[0][0] if self.buckets else 0.0


@dataclass
class PolicyRun:
    """One policy's simulation: per-queue state with its figures and series."""

    policy: str
    queues: dict[str, QueueSim]
    reasons: list[tuple[float, str]]
    deaths: list[float]
    interval_s: float
    step_s: float
    detect_s: float
    over_capacity_rounds: int
    end_s: float
    """When the simulation ended (jobs still waiting then count with their age so far)."""
    """Rounds whose plan asked for more slots than the live hosts have (must be 0)."""


@dataclass
class SimulationResult:
    trace: Trace
    seed: int
    runs: dict[str, PolicyRun]
