"""The manager's memory: latest report per host, a window of counters, broker stats,
the slot map, the decision log and each queue's last hour. Nothing is persisted: a
restarted manager rebuilds the current map from the next reports.

Time is passed in (``now`` = wall-clock seconds), so rounds can be replayed in tests.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from manager.placement import place
from manager.planning import QueueInput, QueuePlan, QueueWindow, band_for, plan
from qcluster.broker.base import QueueStats
from qcluster.config import Settings
from qcluster.messages import (
    Assignment,
    ClusterView,
    DecisionView,
    HistoryPoint,
    HostReport,
    HostView,
    QueueView,
    UndeclaredQueueView,
)
from qcluster.policy import QueuePolicy

HISTORY_S = 3600.0
#: A host is never declared dead sooner than this: a busy machine delays a report or two.
MIN_EXPIRY_S = 5.0
#: A host's latest report older than this many intervals is not counted in a round's jobs.
RECENT_INTERVALS = 2


@dataclass
class HostEntry:
    report: HostReport
    received_at: float


@dataclass
class Sample:
    """One report's counters for one queue, kept for the window."""

    at: float
    processed: int
    busy_s: float
    alive_s: float
    covers_s: float
    """The report interval these counters were counted over (they end at ``at``)."""
    host: str = ""


@dataclass
class QueueTrack:
    samples: deque[Sample] = field(default_factory=deque)
    history: deque[HistoryPoint] = field(default_factory=deque)
    backlog_seen: deque[tuple[float, int]] = field(default_factory=deque)


@dataclass(frozen=True)
class QueueObservation:
    """One queue between two planning rounds, as the recorder writes it."""

    processed: int
    busy_s: float
    backlog: int
    """Ready jobs."""
    locked: int
    """Jobs taken and not settled yet."""
    running: int


@dataclass(frozen=True)
class RoundObservation:
    """What the manager knew at one planning round (``manager.recorder`` writes it down)."""

    hosts: dict[str, tuple[int, bool]]
    """host -> (capacity in slots, alive)."""
    queues: dict[str, QueueObservation]
    policies: dict[str, QueuePolicy]


class ClusterState:
    """Thread-safe: the HTTP handlers and the planning loop share one instance."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.cfg = settings.manager
        self.lock = threading.RLock()
        self.hosts: dict[str, HostEntry] = {}
        self.tracks: dict[str, QueueTrack] = {}
        self.stats: dict[str, QueueStats] = {}
        self.plans: dict[str, QueuePlan] = {}
        self.slot_map: dict[str, dict[str, int]] = {}
        self.generation = 0
        self.decisions: deque[DecisionView] = deque(maxlen=self.cfg.decisions_kept)
        self.paused: set[str] = set()
        self.drained: set[str] = set()
        self.planned_once = False
        self.undeclared: list[UndeclaredQueueView] = []
        self.durability: list[str] = []

    # --- input -----------------------------------------------------------------

    def receive(self, report: HostReport, now: float) -> Assignment:
        """Store a master's report; reply with its row of the slot map."""
        with self.lock:
            self.hosts[report.host] = HostEntry(report, now)
            for queue, counted in report.counters.items():
                track = self.tracks.setdefault(queue, QueueTrack())
                c = counted.counters
                track.samples.append(Sample(now, c.processed, c.busy_s, counted.alive_s,
                                            report.interval_s, report.host))
            for queue in report.queues:
                self.tracks.setdefault(queue, QueueTrack())
            if report.host in self.drained:
                row: dict[str, int] | None = {}  # drained: its slots move to the others
            else:
                row = self.slot_map.get(report.host) if self.planned_once else None
            if row is None:
                row = running_row(report)  # not planned yet: keep what the host runs
            return Assignment(generation=self.generation, row=dict(row),
                              report_interval_s=self.cfg.interval_s)

    def set_stats(self, stats: dict[str, QueueStats]) -> None:
        with self.lock:
            self.stats.update(stats)

    def set_broker_warnings(self, *, undeclared: list[UndeclaredQueueView] | None = None,
                            durability: list[str] | None = None) -> None:
        """What the broker says that no policy covers (None: leave as it is)."""
        with self.lock:
            if undeclared is not None:
                self.undeclared = list(undeclared)
            if durability is not None:
                self.durability = list(durability)

    # --- derived -----------------------------------------------------------------

    def alive_hosts(self, now: float) -> dict[str, HostEntry]:
        expiry = self.cfg.host_expiry_intervals
        return {
            name: entry for name, entry in self.hosts.items()
            if name not in self.drained
            and now - entry.received_at
            <= max(MIN_EXPIRY_S, expiry * max(entry.report.interval_s, self.cfg.interval_s))
        }

    def policies(self, now: float | None = None) -> dict[str, QueuePolicy]:
        """Code defaults reported by live masters (all known ones when ``now`` is None),
        overridden by [queues.NAME] in qcluster.toml. An override that does not fit a
        host's code policy keeps the code policy (the master refuses it at its start)."""
        merged: dict[str, QueuePolicy] = {}
        hosts = self.hosts if now is None else self.alive_hosts(now)
        for entry in hosts.values():
            merged.update(entry.report.queues)
        for name, overrides in self.settings.queues.items():
            base = merged.get(name) or QueuePolicy.model_validate({})
            try:
                merged[name] = base.merged(overrides)
            except ValueError:
                merged[name] = base
        return merged

    def window(self, queue: str, now: float) -> QueueWindow:
        track = self.tracks.get(queue, QueueTrack())
        cutoff = now - self.cfg.window_s
        while track.samples and track.samples[0].at < cutoff:
            track.samples.popleft()
        # The planner's base is the work arriving since its previous round (done + backlog
        # growth), so it also gets the jobs done in one interval and what the sums span.
        span = (now - min(s.at - s.covers_s for s in track.samples)) if track.samples else 0.0
        return QueueWindow(
            processed=sum(s.processed for s in track.samples),
            busy_s=sum(s.busy_s for s in track.samples),
            alive_s=sum(s.alive_s for s in track.samples),
            backlog=self.stats.get(queue, QueueStats()).ready,
            span_s=min(span, self.cfg.window_s),
            recent_s=self.cfg.interval_s if self.planned_once else 0.0,
            recent_processed=done_per_interval(track.samples, now, self.cfg.interval_s),
        )

    def running(self, alive: dict[str, HostEntry]) -> dict[str, dict[str, int]]:
        return {name: running_row(entry.report) for name, entry in alive.items()}

    # --- one planning round ------------------------------------------------------

    def plan_round(self, now: float) -> list[DecisionView]:
        """Plan, place, log decisions; returns the new decisions."""
        with self.lock:
            alive = self.alive_hosts(now)
            running = self.running(alive)
            policies = self.policies(now)
            serves = {name: frozenset(e.report.queues) for name, e in alive.items()}
            inputs = [
                QueueInput(name, policy, sum(row.get(name, 0) for row in running.values()),
                           self.window(name, now), paused=name in self.paused,
                           servable=any(name in queues for queues in serves.values()),
                           previous=self.plans.get(name))
                for name, policy in sorted(policies.items())
            ]
            capacity = {name: e.report.capacity_slots for name, e in alive.items()}
            plans = plan(inputs, sum(capacity.values()), self.cfg.target_utilization)
            new = self._decide(plans, now)
            base = self.slot_map if self.planned_once else running
            order = sorted(policies, key=lambda q: (-policies[q].priority, q))
            slot_map = place(base, {q: p.planned for q, p in plans.items()}, capacity, order,
                             serves)
            if slot_map != self.slot_map:
                self.generation += 1
            self.slot_map, self.plans, self.planned_once = slot_map, plans, True
            self._record_history(now, running)
            return new

    def _decide(self, plans: dict[str, QueuePlan], now: float) -> list[DecisionView]:
        new = []
        for name, queue_plan in plans.items():
            before = self.plans[name].planned if name in self.plans else queue_plan.current
            if queue_plan.planned != before:
                decision = DecisionView.model_validate({
                    "at": now, "queue": name, "from": before, "to": queue_plan.planned,
                    "reason": queue_plan.reason,
                })
                self.decisions.appendleft(decision)
                new.append(decision)
        return new

    def _record_history(self, now: float, running: dict[str, dict[str, int]]) -> None:
        for name, queue_plan in self.plans.items():
            track = self.tracks.setdefault(name, QueueTrack())
            window = self.window(name, now)
            track.history.append(HistoryPoint(
                at=now, backlog=window.backlog, slots_planned=queue_plan.planned,
                slots_current=sum(row.get(name, 0) for row in running.values()),
                load=_defined(queue_plan.load), rate_out=self._rate_out(name, now),
            ))
            while track.history and track.history[0].at < now - HISTORY_S:
                track.history.popleft()

    def _rate_out(self, queue: str, now: float) -> float:
        """Jobs/s processed over the time the held samples cover, not over the whole window:
        a flat rate reads flat from the first report instead of ramping up for a window."""
        self.window(queue, now)  # drops samples older than the window
        samples = self.tracks.get(queue, QueueTrack()).samples
        if not samples:
            return 0.0
        # From the start of the oldest counted interval to the newest report, shared by all
        # hosts: a host that stopped reporting keeps its jobs but not its own shorter span,
        # so its share fades as the others report (as it would over a full window).
        covered = max(s.at for s in samples) - min(s.at - s.covers_s for s in samples)
        return sum(s.processed for s in samples) / covered if covered > 0 else 0.0

    def observe(self, since: float, now: float) -> RoundObservation:
        """Hosts, policies and per-queue counts from reports received in ``(since, now]``.

        ``since`` must lie within the window (older samples are gone): the recorder passes
        the previous round's time.
        """
        with self.lock:
            alive = self.alive_hosts(now)
            running = self.running(alive)
            policies = self.policies(now)
            queues = {}
            for name in sorted(policies):
                self.window(name, now)  # drops samples older than the window
                held = [s for s in self.tracks.get(name, QueueTrack()).samples
                        if since < s.at <= now]
                queues[name] = QueueObservation(
                    processed=sum(s.processed for s in held),
                    busy_s=sum(s.busy_s for s in held),
                    backlog=self.stats.get(name, QueueStats()).ready,
                    locked=self.stats.get(name, QueueStats()).locked,
                    running=sum(row.get(name, 0) for row in running.values()),
                )
            hosts = {name: (entry.report.capacity_slots, name in alive)
                     for name, entry in sorted(self.hosts.items())}
            return RoundObservation(hosts=hosts, queues=queues, policies=policies)

    # --- views -------------------------------------------------------------------

    def view(self, now: float) -> ClusterView:
        with self.lock:
            alive = self.alive_hosts(now)
            running = self.running(alive)
            policies = self.policies(now)
            queues = [self._queue_view(name, policy, running, now)
                      for name, policy in sorted(policies.items())]
            hosts = [self._host_view(name, entry, name in alive)
                     for name, entry in sorted(self.hosts.items())]
            return ClusterView(generated_at=now, queues=queues, hosts=hosts,
                               slot_map={h: dict(r) for h, r in self.slot_map.items()},
                               decisions=list(self.decisions),
                               undeclared_queues=list(self.undeclared),
                               broker_durability=list(self.durability))

    def _queue_view(self, name: str, policy: QueuePolicy,
                    running: dict[str, dict[str, int]], now: float) -> QueueView:
        stats = self.stats.get(name, QueueStats())
        queue_plan = self.plans.get(name)
        current = sum(row.get(name, 0) for row in running.values())
        track = self.tracks.get(name, QueueTrack())
        recent = [p for p in track.history if p.at >= now - self.cfg.window_s]
        avg = sum(p.slots_current for p in recent) / len(recent) if recent else float(current)
        rate_out = self._rate_out(name, now)
        first_backlog = recent[0].backlog if recent else stats.ready
        span = (now - recent[0].at) if len(recent) > 1 else 0.0
        rate_in = rate_out + ((stats.ready - first_backlog) / span if span > 0 else 0.0)
        return QueueView(
            name=name, priority=policy.priority, min_slots=policy.min_slots,
            max_slots=policy.max_slots, slots_current=current,
            slots_planned=queue_plan.planned if queue_plan else current, slots_avg=avg,
            load=_defined(queue_plan.load) if queue_plan else 0.0,
            about_to_resize=queue_plan is not None and queue_plan.needed != current,
            backlog=stats.ready, locked=stats.locked, delayed=stats.delayed, dead=stats.dead,
            rate_in=max(0.0, rate_in), rate_out=rate_out,
            mean_job_seconds=queue_plan.mean_job_s if queue_plan else policy.est_job_seconds,
            paused=name in self.paused,
        )

    def _host_view(self, name: str, entry: HostEntry, alive: bool) -> HostView:
        report = entry.report
        return HostView(
            name=name, alive=alive, capacity_slots=report.capacity_slots,
            slots=running_row(report), planned=dict(self.slot_map.get(name, {})),
            mem_available_bytes=report.facts.mem_available_bytes,
            pss_total_bytes=report.facts.pss_total_bytes, loadavg=report.facts.loadavg,
            last_report_at=entry.received_at,
        )

    def history(self, queue: str) -> list[HistoryPoint]:
        with self.lock:
            return list(self.tracks.get(queue, QueueTrack()).history)

    def metrics_snapshot(self, now: float) -> dict[str, Any]:
        view = self.view(now)
        return {"view": view, "band": {q.name: band_for(q.priority) for q in view.queues}}


def done_per_interval(samples: Iterable[Sample], now: float, interval_s: float) -> int:
    """Jobs done in one planning interval: each host's latest report, as a rate over the
    time it covers. Hosts report on their own phase, a little early or late, so counting
    the reports received since the previous round saw 0, 1 or 2 of a host's."""
    latest: dict[str, Sample] = {}
    for sample in samples:
        if sample.at > now - RECENT_INTERVALS * interval_s:
            latest[sample.host] = sample  # samples are in arrival order: the last one wins
    return round(sum(s.processed / s.covers_s for s in latest.values() if s.covers_s > 0)
                 * interval_s)


def running_row(report: HostReport) -> dict[str, int]:
    row: dict[str, int] = {}
    for slot in report.slots:
        if slot.state != "stopping":
            row[slot.queue] = row.get(slot.queue, 0) + 1
    return row


def _defined(load: float) -> float | None:
    """The load as views show it: None (JSON null) instead of infinity, which is what the
    planner computes when work waits and no slot ran: a ratio with no slot time under it."""
    return load if math.isfinite(load) else None
