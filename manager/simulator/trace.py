"""The trace format (JSON, validated) and the loader for the manager's recordings.

A trace is what the cluster is asked to do: hosts and their capacity, queues with their
policy (the ``@app.queue`` keywords), arrival rates over time and job times, and events
(a host dies, returns, changes capacity). ``load_trace`` reads either a trace (one JSON
document) or a recording written by ``qcluster manager --record`` (JSON Lines).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from qcluster.policy import QueuePolicy

M = TypeVar("M", bound=BaseModel)


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
    per_round: list[int] | None = None
    """Exact job counts per planning round instead of ``rate`` (a replayed recording)."""
    arrivals: Literal["poisson", "even"] = "poisson"
    job_time: JobTime = JobTime()

    @model_validator(mode="after")
    def _sorted(self) -> QueueSpec:
        times = [at for at, _ in self.rate]
        if times != sorted(times):
            raise ValueError("rate points must be sorted by time")
        if any(r < 0 for _, r in self.rate):
            raise ValueError("a rate cannot be negative")
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
    """How old the masters' counts are when a round reads them (they report every interval,
    each on its own phase: half an interval on average)."""
    assign_delay_s: float = Field(default=1.0, ge=0)
    """Seconds from a plan to the hosts acting on it (their next report)."""
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
        text = path.read_text()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror}") from None
    first = text.lstrip().split("\n", 1)[0]
    try:
        head = json.loads(first)
    except json.JSONDecodeError:
        head = None
    if isinstance(head, dict) and head.get("type") == "header":
        return recording_to_trace(text, str(path))
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path}: not JSON: {exc.msg} at line {exc.lineno}") from None
    return parse_trace(data, str(path))


# --- recordings ------------------------------------------------------------------


class _RecHost(BaseModel):
    slots: int = Field(ge=0)
    alive: bool = True


class _RecQueue(BaseModel):
    arrived: int = Field(default=0, ge=0)
    done: int = Field(default=0, ge=0)
    backlog: int = Field(default=0, ge=0)
    mean_job_s: float | None = Field(default=None, gt=0)
    slots: int = Field(default=0, ge=0)


class _RecRound(BaseModel):
    type: Literal["round"]
    t_s: float = Field(ge=0)
    hosts: dict[str, _RecHost] = {}
    queues: dict[str, _RecQueue] = {}


class _RecHeader(BaseModel):
    type: Literal["header"]
    version: Literal[1]
    started_at: float
    interval_s: float = Field(gt=0)
    queues: dict[str, dict[str, Any]] = {}
    hosts: dict[str, _RecHost] = {}


def recording_to_trace(text: str, source: str = "recording") -> Trace:
    """A manager recording (JSON Lines) as a trace: each round's arrivals spread evenly
    over the round, job times exponential with the recorded mean (the policy's estimate
    when none was measured), host capacity and life from each round."""
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    header = _rec_line(_RecHeader, lines[0], source)
    rounds = [_rec_line(_RecRound, line, source) for line in lines[1:]]
    interval = header.interval_s
    policies = {name: dict(fields) for name, fields in header.queues.items()}
    hosts = {name: HostSpec(slots=h.slots) for name, h in header.hosts.items()}
    per_round: dict[str, list[int]] = {name: [] for name in policies}
    means: dict[str, list[tuple[float, float]]] = {name: [] for name in policies}
    events: list[Event] = []
    alive = {name: h.alive for name, h in header.hosts.items()}
    capacity = {name: h.slots for name, h in header.hosts.items()}
    for index, rnd in enumerate(rounds):
        at = index * interval
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
        for name, queue in rnd.queues.items():
            if name not in per_round:
                policies[name], per_round[name], means[name] = {}, [0] * index, []
            per_round[name].append(queue.arrived)
            if queue.mean_job_s is not None:
                means[name].append((at, queue.mean_job_s))
        for counts in per_round.values():
            if len(counts) < index + 1:
                counts.append(0)
    if not hosts:
        raise TraceError(f"{source}: the recording names no host")
    queues = {}
    for name, fields in policies.items():
        est = float(fields.get("est_job_seconds", 0.05))
        first = means[name][0][1] if means[name] else est
        queues[name] = QueueSpec(policy=fields, per_round=per_round[name], arrivals="even",
                                 job_time=JobTime(mean_s=first, changes=means[name]))
    events.sort(key=lambda e: e.at_s)
    data = {"duration_s": max(1, len(rounds)) * interval, "interval_s": interval,
            "hosts": hosts, "queues": queues, "events": events}
    return parse_trace(data, source)


def _rec_line(model: type[M], numbered: tuple[int, str], source: str) -> M:
    number, line = numbered
    try:
        return model.model_validate(json.loads(line))
    except json.JSONDecodeError as exc:
        raise TraceError(f"{source}:{number}: not JSON: {exc.msg}") from None
    except ValidationError as exc:
        raise TraceError(f"{source}:{number}: {_first_error(exc)}") from None
