"""The manager's memory: latest report per host, a window of counters, broker stats,
the slot map, the decision log and each queue's last hour. Nothing is persisted here: a
restarted manager rebuilds the current map from the next reports, and reads the pauses and
drains back from the broker, where the service keeps them (``manager/controls/store.py``).

Plain data, no lock and no I/O: the service (``manager/service.py``) serialises every
access under its lock. Time is passed in (``now`` = wall-clock seconds), so rounds can be
replayed in tests. Reads never change anything; the round drops what is older than the
window (:meth:`ClusterState.prune`) and applies its result (:meth:`ClusterState.apply`).
The views are built from a :class:`Snapshot` by ``manager/views.py``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from qcluster.broker.base import QueueStats
from qcluster.config import Settings
from qcluster.controls import Control, ControlKind
from qcluster.manager.history import HISTORY_S, HISTORY_SPARE, HistoryRing
from qcluster.manager.planning.arrivals import ArrivalCount, ArrivalLedger, unreported
from qcluster.manager.planning.plan import QueueInput, QueuePlan, QueueWindow
from qcluster.manager.planning.rounds import RoundInput, RoundResult, decide
from qcluster.manager.reloads.rollout import Advanced, HostSeen, ReloadBook
from qcluster.messages import (
    Assignment,
    DecisionView,
    HistoryPoint,
    HostReport,
    UndeclaredQueueView,
)
from qcluster.policy import QueuePolicy

#: A host is never declared dead sooner than this: a busy machine delays a report or two.
MIN_EXPIRY_S = 5.0
#: A host's latest report older than this many intervals adds nothing to the jobs a round
#: may count late (the host is late or gone).
RECENT_INTERVALS = 2


@dataclass(frozen=True)
class HostEntry:
    report: HostReport
    received_at: float


@dataclass(frozen=True)
class Sample:
    """One report's counters for one queue, kept for the window."""

    at: float
    processed: int
    busy_s: float
    alive_s: float
    covers_s: float
    """The report interval these counters were counted over (they end at ``at``)."""
    host: str = ""
    batches: int = 0
    batch_s: float = 0.0
    """Seconds in those batches, handler included (BatchCounters.batch_s)."""


@dataclass
class QueueTrack:
    samples: deque[Sample] = field(default_factory=deque)
    history: HistoryRing = field(default_factory=HistoryRing)
    settled: int = 0
    """Jobs processed (done, retried or failed) in every report received, cumulative."""
    ledger: ArrivalLedger = field(default_factory=ArrivalLedger)
    arrived: ArrivalCount | None = None
    """Jobs arrived between the last two rounds (None: no span counted yet)."""
    arrived_s: float = 0.0
    """The seconds between those rounds."""
    counted_at: float | None = None
    """When the last round counted them."""


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
    batches: int = 0
    batch_s: float = 0.0
    """Seconds in those batches, handler included (0: no slot reported it)."""


@dataclass(frozen=True)
class RoundObservation:
    """What the manager knew at one planning round (``manager.planning.recorder`` writes
    it down)."""

    hosts: dict[str, tuple[int, bool]]
    """host -> (capacity in slots, alive)."""
    queues: dict[str, QueueObservation]
    policies: dict[str, QueuePolicy]


@dataclass(frozen=True)
class QueueSnapshot:
    """One queue as the views read it."""

    name: str
    policy: QueuePolicy
    stats: QueueStats
    plan: QueuePlan | None
    running: int
    """Slots running on the live hosts."""
    samples: tuple[Sample, ...]
    """The reports' counters within the window."""
    history: Sequence[HistoryPoint]
    """The round points within the window, oldest first (a HistoryWindow: built when
    read, outside the state lock)."""
    paused: bool


@dataclass(frozen=True)
class HostSnapshot:
    name: str
    entry: HostEntry
    alive: bool
    planned: dict[str, int]


@dataclass(frozen=True)
class Snapshot:
    """A copy of what the views show, taken under the service's lock at ``now``."""

    now: float
    queues: tuple[QueueSnapshot, ...]
    """By name."""
    hosts: tuple[HostSnapshot, ...]
    """By name, dead ones included."""
    slot_map: dict[str, dict[str, int]]
    decisions: tuple[DecisionView, ...]
    """Newest first."""
    undeclared: tuple[UndeclaredQueueView, ...]
    durability: tuple[str, ...]


class ClusterState:
    """Not thread-safe: the service holds its lock around every call."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.cfg = settings.manager
        self.hosts: dict[str, HostEntry] = {}
        self.tracks: dict[str, QueueTrack] = {}
        self.stats: dict[str, QueueStats] = {}
        self.plans: dict[str, QueuePlan] = {}
        self.slot_map: dict[str, dict[str, int]] = {}
        self.generation = 0
        self.rounds = 0
        """Planning rounds applied (the views build the queue rows once per round)."""
        self.decisions: deque[DecisionView] = deque(maxlen=self.cfg.decisions_kept)
        self.paused: set[str] = set()
        self.drained: set[str] = set()
        self.controls: dict[str, Control] = {}
        """The pauses and drains in force with who/when, as the broker last said
        (``manager/controls/store.py``); ``paused`` and ``drained`` follow them."""
        self.planned_once = False
        self.undeclared: list[UndeclaredQueueView] = []
        self.durability: list[str] = []
        self.reloads = ReloadBook()
        """The reload id each host is sent and the current or last rollout
        (``manager/reloads/rollout.py``); forgotten on a restart, so every host is sent ""."""

    # --- input -----------------------------------------------------------------

    def receive(self, report: HostReport, now: float) -> Assignment:
        """Store a master's report; reply with its row of the slot map."""
        self.hosts[report.host] = HostEntry(report, now)
        tracks = self.tracks
        for queue, counted in report.counters.items():
            track = tracks.get(queue)
            if track is None:
                track = tracks[queue] = QueueTrack()
            c = counted.counters
            track.settled += c.processed
            track.samples.append(Sample(now, c.processed, c.busy_s, counted.alive_s,
                                        report.interval_s, report.host, c.batches, c.batch_s))
        for queue in report.queues:
            if queue not in tracks:  # a QueueTrack is made only for a new queue: every
                tracks[queue] = QueueTrack()  # report names all of its app's queues
        if report.host in self.drained:
            row: dict[str, int] | None = {}  # drained: its slots move to the others
        else:
            row = self.slot_map.get(report.host) if self.planned_once else None
        if row is None:
            row = running_row(report)  # not planned yet: keep what the host runs
        return Assignment(generation=self.generation, row=dict(row),
                          report_interval_s=self.cfg.interval_s,
                          reload_id=self.reloads.ids.get(report.host, ""))

    def forget_host(self, host: str) -> bool:
        """A host whose master left: out of the hosts and the slot map (the next round
        plans without it). False: it was not known."""
        if host in self.slot_map:  # replaced whole: a frozen copy may be reading it
            self.slot_map = {name: row for name, row in self.slot_map.items() if name != host}
        return self.hosts.pop(host, None) is not None

    def set_controls(self, controls: dict[str, Control]) -> None:
        """The controls read back from the broker replace the ones held (a second manager,
        or a restart, sees the same pauses and drains)."""
        self.controls = dict(controls)
        self.paused = {c.name for c in controls.values() if c.kind == "pause"}
        self.drained = {c.name for c in controls.values() if c.kind == "drain"}

    def add_control(self, control: Control) -> None:
        self.set_controls({**self.controls, control.key: control})

    def remove_control(self, kind: ControlKind, name: str) -> None:
        self.set_controls({key: c for key, c in self.controls.items()
                           if (c.kind, c.name) != (kind, name)})

    def set_stats(self, stats: dict[str, QueueStats]) -> None:
        self.stats.update(stats)

    def set_broker_warnings(self, *, undeclared: list[UndeclaredQueueView] | None = None,
                            durability: list[str] | None = None) -> None:
        """What the broker says that no policy covers (None: leave as it is)."""
        if undeclared is not None:
            self.undeclared = list(undeclared)
        if durability is not None:
            self.durability = list(durability)

    # --- derived (reads: they change nothing) ----------------------------------------

    def alive_hosts(self, now: float) -> dict[str, HostEntry]:
        """The hosts planned on: reporting and not drained."""
        return {name: entry for name, entry in self.reporting_hosts(now).items()
                if name not in self.drained}

    def reporting_hosts(self, now: float) -> dict[str, HostEntry]:
        """The hosts whose last report is recent (drained ones included)."""
        return {name: entry for name, entry in self.hosts.items()
                if now - entry.received_at <= self.expiry_s(entry.report.interval_s)}

    def expiry_s(self, report_interval_s: float) -> float:
        """How long a host whose master reports every ``report_interval_s`` stays alive
        after its last report."""
        return max(MIN_EXPIRY_S, self.cfg.host_expiry_intervals
                   * max(report_interval_s, self.cfg.interval_s))

    def hosts_seen(self, now: float) -> dict[str, HostSeen]:
        """Every known host's code as a rollout reads it (``manager/reloads/rollout.py``)."""
        reporting = self.reporting_hosts(now)
        return {name: HostSeen(reporting=name in reporting, code=entry.report.code)
                for name, entry in self.hosts.items()}

    def apply_reload(self, advanced: Advanced, now: float) -> None:
        """Keep the rollout, send each asked host its id from now on, log the steps."""
        self.reloads.rollout = advanced.rollout
        for host, reload_id in advanced.asks:
            self.reloads.ids[host] = reload_id
        for reason in advanced.reasons:  # not about one queue: the queue is left empty
            self.decisions.appendleft(DecisionView.model_validate(
                {"at": now, "queue": "", "from": 0, "to": 0, "reason": reason}))

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

    def held(self, queue: str, now: float) -> list[Sample]:
        """The queue's samples within the window at ``now`` (older ones may still be held
        until the next round prunes them)."""
        track = self.tracks.get(queue)
        if track is None:
            return []
        cutoff = now - self.cfg.window_s
        return [s for s in track.samples if s.at >= cutoff]

    def window(self, queue: str, now: float) -> QueueWindow:
        samples = self.held(queue, now)
        # The planner's base is the work arriving since its previous round (counted by
        # count_arrivals), so it also gets what the sums span.
        span = (now - min(s.at - s.covers_s for s in samples)) if samples else 0.0
        track = self.tracks.get(queue)
        arrived = track.arrived if track is not None else None
        return QueueWindow(
            processed=sum(s.processed for s in samples),
            busy_s=sum(s.busy_s for s in samples),
            alive_s=sum(s.alive_s for s in samples),
            backlog=self.stats.get(queue, QueueStats()).ready,
            span_s=min(span, self.cfg.window_s),
            recent_s=track.arrived_s if track is not None and arrived is not None else 0.0,
            recent_arrived=arrived.jobs if arrived is not None else 0,
            recent_margin=arrived.margin if arrived is not None else 0.0,
        )

    def running(self, alive: dict[str, HostEntry]) -> dict[str, dict[str, int]]:
        return {name: running_row(entry.report) for name, entry in alive.items()}

    def history(self, queue: str) -> list[HistoryPoint]:
        track = self.tracks.get(queue)
        return list(track.history) if track is not None else []

    def history_capacity(self) -> int:
        """Points a queue's HistoryRing holds: HISTORY_S at the round interval."""
        return math.ceil(HISTORY_S / self.cfg.interval_s) + HISTORY_SPARE

    # --- one planning round ------------------------------------------------------

    def round_input(self, now: float) -> RoundInput:
        """What the round plans from (observe); :func:`manager.planning.rounds.decide` is
        the rest."""
        alive = self.alive_hosts(now)
        running = self.running(alive)
        policies = self.policies(now)
        serves = {name: frozenset(e.report.queues) for name, e in alive.items()}
        queues = tuple(
            QueueInput(name, policy, sum(row.get(name, 0) for row in running.values()),
                       self.window(name, now), paused=name in self.paused,
                       servable=any(name in queues for queues in serves.values()),
                       previous=self.plans.get(name))
            for name, policy in sorted(policies.items())
        )
        return RoundInput(
            now=now, queues=queues,
            capacity={name: e.report.capacity_slots for name, e in alive.items()},
            serves=serves, base=self.slot_map if self.planned_once else running,
            target_utilization=self.cfg.target_utilization,
        )

    def frozen(self) -> ClusterState:
        """A copy to read outside the service's lock (the round's input, its history
        rates): the containers that reports change in place are copied; the rest is
        replaced whole when it changes (the plans, the slot map, the controls) or is not
        read from the copy."""
        copy = object.__new__(ClusterState)
        copy.__dict__.update(self.__dict__)
        copy.hosts, copy.stats = dict(self.hosts), dict(self.stats)
        copy.tracks = {name: replace(track, samples=deque(track.samples))
                       for name, track in self.tracks.items()}
        return copy

    def rates_out(self, queues: Iterable[str], now: float) -> dict[str, float]:
        """Each queue's jobs/s out over its held samples, as its history point shows it."""
        return {name: rate_out(self.held(name, now)) for name in queues}

    def apply(self, result: RoundResult, rates: Mapping[str, float] | None = None) -> None:
        """Publish the round's plan (the next replies carry it), log its decisions and add
        a history point per queue (``rates``: each one's rate out, when computed outside
        the lock from a :meth:`frozen` copy)."""
        if result.slot_map != self.slot_map:
            self.generation += 1
        self.rounds += 1
        self.slot_map, self.plans, self.planned_once = result.slot_map, result.plans, True
        for decision in result.decisions:
            self.decisions.appendleft(decision)
        self._record_history(result.now, rates)

    def prune(self, now: float) -> None:
        """Drop samples older than the window (the round does it; reads only skip them)."""
        cutoff = now - self.cfg.window_s
        for track in self.tracks.values():
            while track.samples and track.samples[0].at < cutoff:
                track.samples.popleft()

    def count_arrivals(self, now: float) -> None:
        """Each queue's jobs arrived since the previous round (once per round, after the
        broker's stats were set): the rise of the jobs in the broker (ready + locked) plus
        the jobs settled in every report received (``manager/planning/arrivals.py``)."""
        recent = now - RECENT_INTERVALS * self.cfg.interval_s
        for name in self.policies(now):
            track = self.tracks.setdefault(name, QueueTrack())
            latest: dict[str, Sample] = {}
            for sample in track.samples:
                if sample.at > recent:
                    latest[sample.host] = sample  # in arrival order: the last one wins
            rates = [(s.at, s.processed / s.covers_s if s.covers_s > 0 else 0.0)
                     for s in latest.values()]
            stats = self.stats.get(name, QueueStats())
            track.arrived = track.ledger.count(stats.ready + stats.locked, track.settled,
                                               unreported(rates, now))
            track.arrived_s = now - track.counted_at if track.counted_at is not None else 0.0
            track.counted_at = now

    def plan_round(self, now: float) -> list[DecisionView]:
        """A whole round without the broker (tests and replays): prune, count the
        arrivals, plan, place, apply; returns the new decisions."""
        self.prune(now)
        self.count_arrivals(now)
        result = decide(self.round_input(now))
        self.apply(result)
        return result.decisions

    def _record_history(self, now: float, rates: Mapping[str, float] | None) -> None:
        if rates is None:
            rates = self.rates_out(self.plans, now)
        for name, queue_plan in self.plans.items():
            track = self.tracks.setdefault(name, QueueTrack())
            track.history.append(HistoryPoint(
                at=now, backlog=queue_plan.backlog, slots_planned=queue_plan.planned,
                slots_current=queue_plan.current, load=defined(queue_plan.load),
                rate_out=rates.get(name, 0.0),
            ), capacity=self.history_capacity())
            track.history.drop_before(now - HISTORY_S)

    def observation(self, since: float, now: float) -> RoundObservation:
        """Hosts, policies and per-queue counts from reports received in ``(since, now]``
        (and within the window): what the recorder writes for a round."""
        alive = self.alive_hosts(now)
        running = self.running(alive)
        policies = self.policies(now)
        queues = {}
        for name in sorted(policies):
            held = [s for s in self.held(name, now) if since < s.at <= now]
            stats = self.stats.get(name, QueueStats())
            queues[name] = QueueObservation(
                processed=sum(s.processed for s in held),
                busy_s=sum(s.busy_s for s in held),
                backlog=stats.ready, locked=stats.locked,
                running=sum(row.get(name, 0) for row in running.values()),
                batches=sum(s.batches for s in held), batch_s=sum(s.batch_s for s in held),
            )
        hosts = {name: (entry.report.capacity_slots, name in alive)
                 for name, entry in sorted(self.hosts.items())}
        return RoundObservation(hosts=hosts, queues=queues, policies=policies)

    # --- what the views read -------------------------------------------------------

    def snapshot(self, now: float, *, queues_too: bool = True) -> Snapshot:
        """A copy of what the API and the admin page show (``manager.views`` builds them);
        without the queues (``queues_too=False``: the views hold this round's rows)."""
        alive = self.alive_hosts(now)
        running: dict[str, int] = {}
        for row in self.running(alive).values():  # once, not once per queue
            for queue, slots in row.items():
                running[queue] = running.get(queue, 0) + slots
        cutoff = now - self.cfg.window_s
        queues = []
        # Every queue a master ever reported, not only those of the live hosts: when they
        # all stop, the queue's backlog is what the operator most needs to see.
        for name, policy in sorted(self.policies().items() if queues_too else ()):
            track = self.tracks.get(name, QueueTrack())
            queues.append(QueueSnapshot(
                name=name, policy=policy, stats=self.stats.get(name, QueueStats()),
                plan=self.plans.get(name),
                running=running.get(name, 0),
                samples=tuple(self.held(name, now)),
                history=track.history.since(cutoff),
                paused=name in self.paused,
            ))
        hosts = tuple(HostSnapshot(name, entry, name in alive, dict(self.slot_map.get(name, {})))
                      for name, entry in sorted(self.hosts.items()))
        return Snapshot(
            now=now, queues=tuple(queues), hosts=hosts,
            slot_map={host: dict(row) for host, row in self.slot_map.items()},
            decisions=tuple(self.decisions), undeclared=tuple(self.undeclared),
            durability=tuple(self.durability),
        )


def rate_out(samples: Iterable[Sample]) -> float:
    """Jobs/s processed over the time the held samples cover, not over the whole window:
    a flat rate reads flat from the first report instead of ramping up for a window."""
    held = list(samples)
    if not held:
        return 0.0
    # From the start of the oldest counted interval to the newest report, shared by all
    # hosts: a host that stopped reporting keeps its jobs but not its own shorter span,
    # so its share fades as the others report (as it would over a full window).
    covered = max(s.at for s in held) - min(s.at - s.covers_s for s in held)
    return sum(s.processed for s in held) / covered if covered > 0 else 0.0


def running_row(report: HostReport) -> dict[str, int]:
    row: dict[str, int] = {}
    for slot in report.slots:
        if slot.state != "stopping":
            row[slot.queue] = row.get(slot.queue, 0) + 1
    return row


def defined(load: float) -> float | None:
    """The load as views show it: None (JSON null) instead of infinity, which is what the
    planner computes when work waits and no slot ran: a ratio with no slot time under it."""
    return load if math.isfinite(load) else None
