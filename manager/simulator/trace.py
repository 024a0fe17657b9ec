"""The trace format (JSON, validated) and the loader for the manager's recordings.

A trace is what the cluster is asked to do: hosts and their capacity, queues with their
policy (the ``@app.queue`` keywords), arrival rates over time and job times, and events
(a host dies, returns, changes capacity). ``load_trace`` reads either a trace (one JSON
document) or a recording written by ``qcluster manager --record`` (JSON Lines, read with
the recorder's own models: ``manager/planning/recorder.py`` owns that format).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from qcluster.manager.planning.recorder import (
    RecordHeader,
    RecordLine,
    RecordRound,
    RoundQueue,
    parse_record_line,
)
from qcluster.policy import QueuePolicy

logger = logging.getLogger(__name__)


class TraceError(ValueError):
    """A trace that cannot be read; the message is one line naming where and why."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class JobTime(_Strict):
    """Seconds one job takes in its handler."""

    dist: Literal["exponential", "fixed"] = "exponential"
    mean_s: float = Field(default=0.05, gt=0)
    changes: list[tuple[float, float]] = []
    """``[[at_s, mean_s], ...]``: the mean from ``at_s`` on (a replayed recording's)."""


class QueueSpec(_Strict):
    """One queue: its policy, its arrivals, its job times."""

    policy: dict[str, Any] = {}
    """Keywords as in ``@app.queue`` / ``[queues.NAME]`` (priority, min_slots, ...)."""
    rate: list[tuple[float, float]] = []
    """``[[at_s, jobs_per_s], ...]``, sorted by time: the rate from ``at_s`` on (step), or
    between points (``shape: linear``). Before the first point the rate is 0."""
    shape: Literal["step", "linear"] = "step"
    period_s: float | None = Field(default=None, gt=0)
    """Repeat ``rate`` every ``period_s`` seconds."""
    per_round: list[Annotated[int, Field(ge=0)]] | None = None
    """Exact job counts per planning round instead of ``rate`` (a replayed recording)."""
    arrivals: Literal["poisson", "even"] = "poisson"
    every_s: float | None = Field(default=None, gt=0)
    """A periodic job: ``tick_jobs`` jobs at each multiple of ``every_s`` seconds (on top
    of ``rate``); the manager knows the schedule (it pre-warms a slot)."""
    tick_jobs: int = Field(default=1, ge=1)
    batch_cost_s: float = Field(default=0.0, ge=0)
    """Seconds a slot spends per batch beyond its jobs' handler time (take, settle,
    report; a busy host's contention). The planner sees handler time only, as from the
    masters. A replayed recording's is measured by its slots (:class:`BatchCosts`)."""
    start_slots: int = Field(default=0, ge=0)
    """Slots already running when the trace begins, placed as the manager would (a replayed
    recording's: those its first round found running); 0: every queue starts cold."""
    job_time: JobTime = JobTime()

    @model_validator(mode="after")
    def _sorted(self) -> QueueSpec:
        times = [at for at, _ in self.rate]
        if times != sorted(times):
            raise ValueError("rate points must be sorted by time")
        if any(r < 0 for _, r in self.rate):
            raise ValueError("a rate cannot be negative")
        if self.per_round is not None and self.rate:
            raise ValueError("per_round replaces rate: give one of them")
        return self

    def queue_policy(self) -> QueuePolicy:
        return QueuePolicy.model_validate(self.policy)


class HostSpec(_Strict):
    slots: int = Field(ge=0)
    """Capacity in slots."""
    serves: list[str] | None = None
    """Queues its application declares (None: all)."""


class Event(_Strict):
    at_s: float = Field(ge=0)
    host: str
    event: Literal["die", "return", "capacity"]
    slots: int | None = Field(default=None, ge=0)
    """The new capacity (``capacity``; optional on ``return``)."""


class Trace(_Strict):
    """Everything one simulation needs; seconds throughout."""

    duration_s: float = Field(gt=0)
    interval_s: float = Field(default=2.0, gt=0)
    """The manager's planning interval (``[manager] interval_s``)."""
    window_s: float = Field(default=60.0, gt=0)
    target_utilization: float = Field(default=0.8, gt=0, le=1)
    host_expiry_intervals: int = Field(default=3, ge=1)
    step_s: float = Field(default=0.5, gt=0)
    """Simulation step: waits are measured to this resolution."""
    slot_start_s: float = Field(default=1.0, ge=0)
    """Seconds from a host learning of a new slot to the slot taking jobs (fork, import)."""
    slot_drain_s: float = Field(default=0.5, ge=0)
    """Seconds a stopped slot keeps its place while it finishes its batch."""
    report_lag_s: float = Field(default=1.0, ge=0)
    """How old the masters' latest reports are when a round reads them: the jobs they
    finished are known up to then (masters report every interval, each on its own phase:
    half an interval on average), the jobs in the broker up to the round."""
    report_jitter_s: float = Field(default=0.0, ge=0)
    """Each report is this much early or late at most (uniform, from the seed; capped just
    under half an interval, so reports keep their order): a busy host's."""
    assign_delay_s: float = Field(default=1.0, ge=0)
    """Seconds from a plan to the hosts acting on it (their next report)."""
    first_round_s: float = Field(default=0.0, ge=0)
    """The manager's first planning round: before it no round plans (the slots are the
    queues' ``start_slots``) and its first round counts no arrivals, as a manager just
    started. A replayed recording's is its first round, one interval in: each round's
    arrivals are replayed in the interval after it, and the recording began there."""
    hosts: dict[str, HostSpec] = Field(min_length=1)
    queues: dict[str, QueueSpec] = Field(min_length=1)
    events: list[Event] = []

    @model_validator(mode="after")
    def _consistent(self) -> Trace:
        for event in self.events:
            if event.host not in self.hosts:
                raise ValueError(f"event at {event.at_s:g}s names unknown host {event.host!r}")
            if event.event == "capacity" and event.slots is None:
                raise ValueError(f"capacity event at {event.at_s:g}s needs 'slots'")
        for host, host_spec in self.hosts.items():
            unknown = sorted(set(host_spec.serves or ()) - set(self.queues))
            if unknown:
                raise ValueError(f"hosts.{host}.serves names no queue of the trace: "
                                 f"{', '.join(map(repr, unknown))}")
        for name, spec in self.queues.items():
            try:
                spec.queue_policy()
            except ValidationError as exc:
                raise ValueError(f"queue {name!r}: {_first_error(exc)}") from None
        if self.step_s > self.interval_s:
            raise ValueError("step_s must not exceed interval_s")
        return self

    def policies(self) -> dict[str, QueuePolicy]:
        return {name: spec.queue_policy() for name, spec in self.queues.items()}


def with_settings(trace: Trace, queues: dict[str, dict[str, Any]],
                  target_utilization: float | None) -> tuple[Trace, list[str]]:
    """The trace as a manager with these settings plans it: each ``[queues.NAME]``'s keys
    over that queue's policy (as the manager merges them over the code's), and the target
    utilization when given; with the ``[queues.NAME]`` that name no queue of the trace."""
    specs = dict(trace.queues)
    for name, overrides in queues.items():
        if name in specs:
            try:
                policy = specs[name].queue_policy().merged(dict(overrides))
            except ValidationError as exc:
                raise TraceError(f"[queues.{name}] does not fit the trace's policy: "
                                 f"{_first_error(exc)}") from None
            specs[name] = specs[name].model_copy(update={"policy": policy.model_dump()})
    update: dict[str, Any] = {"queues": specs}
    if target_utilization is not None:
        update["target_utilization"] = target_utilization
    return trace.model_copy(update=update), sorted(set(queues) - set(trace.queues))


def _first_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"])
    message = str(error["msg"]).removeprefix("Value error, ")
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{where}: {message}{more}" if where else f"{message}{more}"


def parse_trace(data: Any, source: str = "trace") -> Trace:
    try:
        return Trace.model_validate(data)
    except ValidationError as exc:
        raise TraceError(f"{source}: {_first_error(exc)}") from None


def load_trace(path: Path) -> Trace:
    """A trace file (JSON) or a manager recording (JSON Lines), validated."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise TraceError(f"{path}:{line}: not UTF-8 text (byte {exc.object[exc.start]:#04x} "
                         f"at offset {exc.start}): a trace is JSON, a recording JSON Lines"
                         ) from None
    first = text.lstrip().split("\n", 1)[0]
    try:
        head = _json(first)
    except ValueError:
        head = None
    if isinstance(head, dict) and head.get("type") == "header":
        return recording_to_trace(text, str(path))
    try:
        data = _json(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path}: not JSON: {exc.msg} at line {exc.lineno}") from None
    except NonFiniteNumber as exc:
        raise TraceError(f"{path}: not JSON: {exc}") from None
    return parse_trace(data, str(path))


class NonFiniteNumber(ValueError):
    """NaN or Infinity: Python's json reads them, JSON has no such numbers."""


def _refuse_constant(name: str) -> float:
    raise NonFiniteNumber(f"{name} is not a number JSON has (a trace's numbers are finite)")


def _json(text: str) -> Any:
    """``json.loads`` without NaN and Infinity: a rate or a duration of either ran as no
    jobs at all, or ended in a traceback."""
    return json.loads(text, parse_constant=_refuse_constant)


# --- recordings ------------------------------------------------------------------


#: A queue a round names without carrying its policy replays with this one.
DEFAULT_POLICY = QueuePolicy.model_validate({})

TINY_JOB_S = 1e-4
"""A measured mean of 0 (jobs faster than the clock tells): replayed as 0.1 ms per job."""


def _replayed_queue(policy: QueuePolicy, per_round: list[int],
                    means: list[tuple[float, float]], costs: BatchCosts,
                    start_slots: int) -> QueueSpec:
    """One recorded queue as a trace's: its rounds' arrivals spread evenly, its measured
    job times (the policy's estimate before the first), its cost per batch."""
    mean = means[0][1] if means else policy.est_job_seconds
    return QueueSpec(policy=policy.model_dump(), per_round=per_round, arrivals="even",
                     job_time=JobTime(mean_s=mean, changes=means),
                     batch_cost_s=costs.cost(policy), start_slots=start_slots)


def recording_to_trace(text: str, source: str = "recording") -> Trace:
    """A manager recording (JSON Lines) as a trace: each round's arrivals spread evenly
    over the round, job times exponential with the recorded mean (the policy's estimate
    when none was measured), host capacity and life from each round. A later header (a
    restarted manager) continues the timeline at its ``started_at``."""
    lines = _rec_lines(text, source)
    first = lines[0]
    if not isinstance(first, RecordHeader):
        raise TraceError(f"{source}:1: a recording starts with a header")
    interval = first.interval_s
    utilization = first.target_utilization
    policies: dict[str, QueuePolicy] = {}
    hosts: dict[str, HostSpec] = {}
    per_round: dict[str, list[int]] = {}
    means: dict[str, list[tuple[float, float]]] = {}
    costs: dict[str, BatchCosts] = {}
    waiting: dict[str, bool] = {}
    start_slots: dict[str, int] = {}
    """The slots each queue ran at the recording's first round (before it, masters ran)."""
    events: list[Event] = []
    alive: dict[str, bool] = {}
    capacity: dict[str, int] = {}
    index = 0
    for line in lines:
        if isinstance(line, RecordHeader):
            # a restart: rounds go on from the new start; the gap between has no rounds
            index = max(index, round((line.started_at - first.started_at) / interval))
            utilization = line.target_utilization  # one per trace: the last manager's
            _new_policies(line.queues, policies, per_round, means, index)
            _header_hosts(line, index * interval, hosts, alive, capacity, events)
            continue
        at = index * interval
        _new_policies(line.policies, policies, per_round, means, index)
        _round_hosts(line, at, index, hosts, alive, capacity, events)
        for name, queue in line.queues.items():
            if name not in per_round:  # no policy carried for it: the defaults
                _new_policies({name: DEFAULT_POLICY}, policies, per_round, means, index)
            if not index:
                start_slots[name] = queue.slots
            _pad(per_round[name], index)
            per_round[name].append(queue.arrived)
            if queue.mean_job_s is not None:
                means[name].append((at, queue.mean_job_s or TINY_JOB_S))
                costs.setdefault(name, BatchCosts()).add(
                    queue, interval, saturated=bool(waiting.get(name) and queue.backlog))
            waiting[name] = queue.backlog > 0
        index += 1
    for counts in per_round.values():
        _pad(counts, index)
    if not hosts:
        raise TraceError(f"{source}: the recording names no host")
    queues = {name: _replayed_queue(policy, per_round[name], means[name],
                                    costs.get(name, BatchCosts()), start_slots.get(name, 0))
              for name, policy in policies.items()}
    events.sort(key=lambda e: e.at_s)
    data = {"duration_s": max(1, index) * interval, "interval_s": interval,
            "target_utilization": utilization,
            "first_round_s": interval,
            "hosts": hosts, "queues": queues, "events": events}
    return parse_trace(data, source)


def _header_hosts(header: RecordHeader, at: float, hosts: dict[str, HostSpec],
                  alive: dict[str, bool], capacity: dict[str, int],
                  events: list[Event]) -> None:
    """A header's hosts not seen before; one first named by a restarted manager's header
    (``at`` > 0) was away until then."""
    for name, host in header.hosts.items():
        if name not in hosts:
            hosts[name] = HostSpec(slots=host.slots)
            capacity[name], alive[name] = host.slots, True
            if at:
                events.append(Event(at_s=0.0, host=name, event="die"))
                events.append(Event(at_s=at, host=name, event="return"))


#: Saturated rounds a batch cost is fitted from (fewer: none is fitted).
MIN_SATURATED_ROUNDS = 3


class BatchCosts:
    """A recorded queue's cost per batch beyond its handler, from its rounds.

    Measured where the slots report it (``batches`` and ``batch_s`` in a round): the
    seconds in batches less the handler's, over the batches, summed over the recording.
    A sum, not a median over rounds: the replay charges every batch the same cost, so the
    slot-seconds it takes are right when the cost is the mean per batch, and a round
    with a few batches weighs as little as it costs. The time slots waited for jobs is
    not in it (``BatchCounters.batch_s``).

    Fitted where they do not (a recording older than the fields): the median, over the
    rounds with a backlog at both ends, of slot-seconds per job done less the job time,
    times ``batch_size``; it counts the seconds slots idled in such rounds (a backlog
    standing between the load's ticks), so it overstates a batch's cost.
    """

    def __init__(self) -> None:
        self.batches = 0
        self.over_s = 0.0
        """Seconds in the measured batches beyond their handler."""
        self.saturated: list[float] = []
        """Slot-seconds per job done beyond the job time, in the saturated rounds."""

    def add(self, queue: RoundQueue, interval_s: float, *, saturated: bool) -> None:
        """A round in which ``queue.done`` jobs were done (their mean time measured)."""
        assert queue.mean_job_s is not None
        if queue.batches and queue.batch_s > 0:
            self.batches += queue.batches
            self.over_s += queue.batch_s - queue.mean_job_s * queue.done
        if saturated and queue.slots and queue.done:
            self.saturated.append(queue.slots * interval_s / queue.done - queue.mean_job_s)

    @property
    def measured(self) -> bool:
        return self.batches > 0

    def cost(self, policy: QueuePolicy) -> float:
        """Seconds per batch beyond the handler's (0 when neither measured nor fitted)."""
        if self.measured:
            return max(0.0, self.over_s / self.batches)
        if len(self.saturated) < MIN_SATURATED_ROUNDS:
            return 0.0
        median = sorted(self.saturated)[len(self.saturated) // 2]
        return max(0.0, median) * policy.batch_size


def _pad(counts: list[int], length: int) -> None:
    counts.extend([0] * (length - len(counts)))


def _new_policies(carried: dict[str, QueuePolicy], policies: dict[str, QueuePolicy],
                  per_round: dict[str, list[int]],
                  means: dict[str, list[tuple[float, float]]], index: int) -> None:
    """Policies a header or round carries: a new queue joins (no arrivals before), a
    changed policy replaces the old one (a trace holds one policy per queue: the last)."""
    for name, policy in carried.items():
        if name not in per_round:
            per_round[name], means[name] = [0] * index, []
        policies[name] = policy


def _round_hosts(rnd: RecordRound, at: float, index: int, hosts: dict[str, HostSpec],
                 alive: dict[str, bool], capacity: dict[str, int], events: list[Event]) -> None:
    for name, host in rnd.hosts.items():
        if name not in hosts:
            hosts[name] = HostSpec(slots=host.slots)
            capacity[name], alive[name] = host.slots, True
            if index:  # first seen later: absent until then
                events.append(Event(at_s=0.0, host=name, event="die"))
                events.append(Event(at_s=at, host=name, event="return"))
        if host.alive != alive[name]:
            events.append(Event(at_s=at, host=name, event="return" if host.alive else "die"))
            alive[name] = host.alive
        if host.slots != capacity[name]:
            events.append(Event(at_s=at, host=name, event="capacity", slots=host.slots))
            capacity[name] = host.slots


def _rec_lines(text: str, source: str) -> list[RecordLine]:
    """Every line validated with the recorder's models (keys this version does not know are
    ignored); a last line without its newline that is not JSON is what a crash mid-write
    leaves (the recorder flushes whole lines): skipped with a warning."""
    raw = text.split("\n")  # not splitlines(): JSON may hold U+2028 unescaped
    parsed = []
    for number, line in enumerate(raw, start=1):
        if not line.strip():
            continue
        try:
            data = _json(line)
        except NonFiniteNumber as exc:
            raise TraceError(f"{source}:{number}: not JSON: {exc}") from None
        except json.JSONDecodeError as exc:
            if number == len(raw):
                logger.warning("%s:%d: torn last line skipped (a crash mid-write?)",
                               source, number)
                break
            raise TraceError(f"{source}:{number}: not JSON: {exc.msg}") from None
        try:
            parsed.append(parse_record_line(data))
        except ValidationError as exc:
            raise TraceError(f"{source}:{number}: {_first_error(exc)}") from None
    if not parsed:
        raise TraceError(f"{source}: empty recording")
    return parsed
