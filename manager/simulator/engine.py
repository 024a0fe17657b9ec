"""The simulation: simulated masters and queues around the manager's real planning and
placement, one policy at a time, deterministic from the trace and the seed.

Each planning round (every ``interval_s``) the policy sees what the manager would see —
per queue the running slots, a window of counts (processed, busy, slot-alive seconds),
the backlog — and answers slots per queue; ``manager.planning.placement.place`` turns that into a
slot map, which the hosts act on ``assign_delay_s`` later. Between rounds the simulation
advances in steps of ``step_s``: new slots take jobs ``slot_start_s`` after they are
forked, stopped slots keep their place ``slot_drain_s`` while they finish, hosts die,
return and change capacity, and each queue's active slots run its jobs.

Jobs are counted exactly, in buckets of jobs that arrived in the same step: a job waits
in its queue (first in, first out) until a slot takes it in a batch (up to
``batch_size``: as many batches as the slots' spare time allows, each costing
``batch_cost_s`` beyond its jobs' handler time), and finishes when its batch is settled,
once the queue's slots have worked through it. Slots run a queue's work as one pool
(``A`` active slots give ``A * step_s`` seconds of work per step, batches settling in the
order taken, each once the pool has done its share of its take's work, at most one held
per slot); a job's wait is measured in whole steps. The
jobs a host held when it dies come back ready when their locks expire
(``lock_timeout``), with their enqueue time. Not modelled: retries and failures, the
broker's own latency, CPU shared between a host's slots.
"""

from __future__ import annotations

import heapq
import math
import random
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from qcluster.manager.planning.arrivals import ArrivalCount
from qcluster.manager.planning.placement import place
from qcluster.manager.planning.plan import QueueInput, QueueWindow
from qcluster.manager.simulator.arrivals import Arrivals, JobTimes
from qcluster.manager.simulator.batches import (
    lose,
    redeliver,
    settle,
    take,
    take_batches,
    watch_oldest,
)
from qcluster.manager.simulator.model import (
    Host,
    HostSlots,
    PolicyRun,
    QueueFigures,
    QueueSim,
    Series,
    SimulationResult,
)
from qcluster.manager.simulator.policies import POLICIES, Policy, QclusterPolicy, make_policy
from qcluster.manager.simulator.round_end import close_round
from qcluster.manager.simulator.trace import Trace

__all__ = ["Host", "HostSlots", "PolicyRun", "QueueFigures", "QueueSim", "Series",
           "Simulation", "SimulationResult", "simulate"]

#: Charts keep at most this many points per series (longer runs are summarised in chunks).
MAX_POINTS = 1500
EPS = 1e-9
#: Told after each simulated round: the policy, the rounds done, the rounds in all.
Progress = Callable[[str, int, int], None]


def _seed(seed: int, *parts: str) -> int:
    """A stable per-queue seed (``hash`` of a str changes between processes)."""
    return zlib.crc32("/".join([str(seed), *parts]).encode())


#: (index before, index after, share of the step) in ``Simulation.settled_at``: the jobs
#: finished by a moment, interpolated; no share: the count at the first index (-1: none).
SettledPoint = tuple[int, int, float | None]
#: (sent at, the report before sent at, their SettledPoints): the masters' latest report.
Report = tuple[float, float, SettledPoint, SettledPoint]


def finished_by(settled: deque[int], point: SettledPoint) -> int:
    """A queue's jobs finished by the moment ``point`` stands for (``settled_point``)."""
    lo, hi, share = point
    if share is None:
        return settled[lo] if lo >= 0 else 0
    return settled[lo] + math.floor(share * (settled[hi] - settled[lo]) + EPS)



class Simulation:
    def __init__(self, trace: Trace, policy: Policy, seed: int) -> None:
        self.trace, self.policy, self.seed = trace, policy, seed
        self.steps = max(1, round(trace.interval_s / trace.step_s))
        self.dt = trace.interval_s / self.steps
        self.hosts = {
            name: Host(name, spec.slots, frozenset(spec.serves) if spec.serves is not None
                       else None)
            for name, spec in trace.hosts.items()
        }
        self.queues = {
            name: QueueSim(name, spec.queue_policy(),
                           Arrivals(spec, _seed(seed, "arrivals", name), trace.interval_s),
                           JobTimes(spec.job_time, _seed(seed, "jobs", name)))
            for name, spec in sorted(trace.queues.items())
        }
        for name, q in self.queues.items():
            q.batch_cost_s = trace.queues[name].batch_cost_s
        self.order = sorted(self.queues, key=lambda q: (-self.queues[q].policy.priority, q))
        self.every_queue = frozenset(self.queues)
        self.events = sorted(trace.events, key=lambda e: e.at_s)
        self.next_event = 0
        self.heap: list[tuple[float, int, str, str, str, int]] = []
        self.seq = 0
        self.slot_map: dict[str, dict[str, int]] = {}
        self.placed_for: Any = None
        self.pending: tuple[float, dict[str, dict[str, int]]] | None = None
        self.window_rounds = max(1, round(trace.window_s / trace.interval_s))
        #: Steps of finished counts kept: the reports' lag and jitter, two report intervals.
        self.settled_kept = math.ceil((trace.report_lag_s + trace.report_jitter_s
                                       + 2 * trace.interval_s) / self.dt) + 2
        #: When each of the steps in ``QueueSim.settled`` ended: the same for every queue,
        #: so where a report falls among them is found once per round, not per queue.
        self.settled_at: deque[float] = deque()
        self.detect_s = trace.host_expiry_intervals * trace.interval_s
        self.rounds = math.ceil(trace.duration_s / trace.interval_s - EPS)
        self.chunk = max(1, math.ceil(self.rounds / MAX_POINTS))
        self.deaths: list[float] = []
        self.over_capacity = 0

    def start_running(self, slots: dict[str, int]) -> None:
        """Slots running when the trace begins (``start_slots``), placed as the manager
        would; not slot moves (they were started before)."""
        if not slots:
            return
        hosts = [h for h in self.hosts.values() if h.alive]
        serves = {h.name: h.serves if h.serves is not None else self.every_queue for h in hosts}
        planned = {name: slots.get(name, 0) for name in self.queues}
        placed = place({}, planned, {h.name: h.capacity for h in hosts}, self.order, serves)
        self.slot_map = placed
        for host in hosts:
            host.row = dict(placed.get(host.name, {}))
            for name, count in placed.get(host.name, {}).items():
                if not count:
                    continue
                host.slots[name] = HostSlots(active=count)
                host.used += count
                q = self.queues[name]
                q.active += count
                q.existing += count

    # --- the manager's view -----------------------------------------------------

    def believed_alive(self, now: float) -> list[Host]:
        """Hosts whose reports the manager still counts (a dead one until it expires)."""
        return [h for h in self.hosts.values()
                if h.alive or now - h.died_at < self.detect_s - EPS]

    def inputs(self, now: float, seen: list[Host]) -> list[QueueInput]:
        everything = any(h.serves is None for h in seen)
        served = frozenset().union(*(h.serves for h in seen if h.serves is not None))
        previous = self.policy.plans
        report = self.latest_report(now)
        interval, window_rounds = self.trace.interval_s, self.window_rounds
        out = []
        for name, q in self.queues.items():
            # What the masters report running: forked slots, started or starting (a dead
            # host's are gone at once here; the manager would count them until expiry).
            current = q.active + q.starting
            span = min(len(q.window), window_rounds) * interval
            arrived = self.reported_arrivals(q, now, report)
            if arrived is None:
                window = QueueWindow(q.win_processed, q.win_busy, q.win_alive, q.backlog,
                                     span_s=span, recent_s=0)
            else:
                window = QueueWindow(q.win_processed, q.win_busy, q.win_alive, q.backlog,
                                     span_s=span, recent_s=interval,
                                     recent_arrived=arrived.jobs, recent_margin=arrived.margin)
            out.append(QueueInput(name, q.policy, current, window,
                                  servable=everything or name in served,
                                  previous=previous.get(name),
                                  next_tick_s=None if q.arrivals.every_s is None
                                  else q.arrivals.next_tick_s(now)))
        return out

    def report_time(self, j: int) -> float:
        """When the masters' ``j``-th report was sent: every interval, ``report_lag_s``
        before a round, ``report_jitter_s`` early or late (drawn from the seed)."""
        interval = self.trace.interval_s
        at = j * interval - self.trace.report_lag_s
        jitter = min(self.trace.report_jitter_s, 0.49 * interval)
        if jitter:
            at += random.Random(_seed(self.seed, "report", str(j))).uniform(-jitter, jitter)
        return at

    def settled_point(self, at: float) -> SettledPoint:
        """Where ``at`` falls among the recent steps' ends (``settled_at``), for
        :func:`finished_by`: the jobs finished by then are linear within a step (the
        simulation finishes a step's jobs together)."""
        before = -math.inf
        for i, when in enumerate(self.settled_at):
            if when >= at - EPS:
                if when - before > EPS and before > -math.inf:
                    return i - 1, i, (at - before) / (when - before)
                return (i if when <= at + EPS else i - 1), -1, None
            before = when
        return len(self.settled_at) - 1, -1, None

    def latest_report(self, now: float) -> Report | None:
        """The masters' latest report at ``now``: when it and the one before were sent and
        where they fall among the steps (None: no report sent yet). The same for every
        queue: found once per round."""
        j = math.floor((now + self.trace.report_lag_s) / self.trace.interval_s) + 1
        while j > 0 and self.report_time(j) > now + EPS:
            j -= 1
        if j <= 0:
            return None
        sent, before = self.report_time(j), max(0.0, self.report_time(j - 1))
        return sent, before, self.settled_point(sent), self.settled_point(before)

    def reported_arrivals(self, q: QueueSim, now: float,
                          report: Report | None) -> ArrivalCount | None:
        """Jobs arrived since the previous round as the manager counts them
        (``manager.planning.arrivals``): the jobs in the broker now (waiting, or started and not
        finished) and the jobs finished as the masters' latest report tells them, complete
        up to when it was sent (``report_lag_s`` before the round, give or take
        ``report_jitter_s``); the jobs finished since, estimated from its rate, make the
        count's margin."""
        in_broker = q.backlog + q.started - q.finished + q.locked_lost
        if report is None:
            return q.ledger.count(in_broker, 0, 0.0)
        sent, before, at_sent, at_before = report
        reported = finished_by(q.settled, at_sent)
        rate = (reported - finished_by(q.settled, at_before)) / max(sent - before, EPS)
        return q.ledger.count(in_broker, reported, rate * (now - sent))

    def plan_round(self, index: int, now: float) -> None:
        seen = self.believed_alive(now)
        capacity = {h.name: h.capacity for h in seen}
        inputs = self.inputs(now, seen)
        planned = self.policy.decide(now, inputs, sum(capacity.values()))
        if sum(planned.values()) > sum(capacity.values()):
            self.over_capacity += 1
        for name, q in self.queues.items():
            if q.planned >= 0 and planned[name] != q.planned:
                q.plan_moves.append((now, q.planned, planned[name]))
            q.planned = planned[name]
        key = (tuple(sorted(planned.items())), tuple(sorted(capacity.items())))
        if key != self.placed_for:
            serves = {h.name: h.serves if h.serves is not None else self.every_queue
                      for h in seen}
            self.slot_map = place(self.slot_map, planned, capacity, self.order, serves)
            self.placed_for = key
            self.pending = (now + self.trace.assign_delay_s, self.slot_map)

    # --- simulated masters --------------------------------------------------------

    def push(self, at: float, kind: str, host: Host, queue: str) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (at, self.seq, kind, host.name, queue, host.epoch))

    def reconcile(self, host: Host, now: float) -> None:
        """Start or stop slots until the host runs its row (as far as capacity allows)."""
        if not host.alive:
            return
        row, held = host.row, host.slots
        for name in row.keys() - held.keys():
            held[name] = HostSlots()
        # Most queues, most rounds: nothing to start or stop; the others in name order.
        for name in sorted([n for n, s in held.items() if s.active + s.starting != row.get(n, 0)]):
            want, slots = row.get(name, 0), held[name]
            have = slots.active + slots.starting
            q = self.queues[name]
            while have > want:
                if slots.starting:
                    slots.starting -= 1
                    slots.cancelled += 1
                    q.starting -= 1
                    q.existing -= 1
                    host.used -= 1
                else:
                    slots.active -= 1
                    slots.draining += 1
                    q.active -= 1
                    q.draining += 1
                    self.push(now + self.trace.slot_drain_s, "drained", host, name)
                q.stops += 1
                q.move_times.append(now)
                have -= 1
            free = host.capacity - host.used
            while have < want and free > 0:
                slots.starting += 1
                q.starting += 1
                host.used += 1
                q.existing += 1
                q.starts += 1
                q.move_times.append(now)
                self.push(now + self.trace.slot_start_s, "ready", host, name)
                have += 1
                free -= 1

    def slot_events(self, now: float) -> None:
        touched: set[str] = set()
        while self.heap and self.heap[0][0] <= now + EPS:
            _, _, kind, host_name, name, epoch = heapq.heappop(self.heap)
            host = self.hosts[host_name]
            if epoch != host.epoch:
                continue
            slots = host.slots[name]
            if kind == "ready":
                if slots.cancelled:
                    slots.cancelled -= 1
                    continue
                slots.starting -= 1
                slots.active += 1
                self.queues[name].active += 1
                self.queues[name].starting -= 1
            else:
                q = self.queues[name]
                if not q.active and q.assigned - q.done_work > EPS:
                    # The queue's last slots: a stopped slot finishes its batch first.
                    self.push(now + self.dt, "drained", host, name)
                    continue
                slots.draining -= 1
                q.draining -= 1
                host.used -= 1
                q.existing -= 1
                touched.add(host_name)
        for host_name in sorted(touched):  # room freed: starts that waited for it
            self.reconcile(self.hosts[host_name], now)

    def host_events(self, now: float) -> None:
        while (self.next_event < len(self.events)
               and self.events[self.next_event].at_s <= now + EPS):
            event = self.events[self.next_event]
            self.next_event += 1
            host = self.hosts[event.host]
            if event.event == "die" and host.alive:
                self.kill(host, now)
            elif event.event == "return" and not host.alive:
                host.alive = True
                host.capacity = event.slots if event.slots is not None else host.capacity
                # Its first report gets its row of the current map (empty if the manager
                # noticed the death and placed its slots elsewhere).
                host.row = dict(self.slot_map.get(host.name, {}))
                self.reconcile(host, now)
            elif event.event == "capacity":
                host.capacity = event.slots or 0
                self.reconcile(host, now)

    def kill(self, host: Host, now: float) -> None:
        for name, slots in host.slots.items():
            q = self.queues[name]
            working = q.active + q.draining
            if working and slots.active + slots.draining:
                share = (slots.active + slots.draining) / working
                lose(q, now, round(share * (q.started - q.finished)), self.dt)
            q.active -= slots.active
            q.starting -= slots.starting
            q.draining -= slots.draining
            q.existing -= slots.active + slots.starting + slots.draining
        host.slots, host.row, host.alive, host.died_at, host.used = {}, {}, False, now, 0
        host.epoch += 1
        self.deaths.append(now)

    def assign(self, now: float) -> None:
        if self.pending is None or self.pending[0] > now + EPS:
            return
        slot_map = self.pending[1]
        self.pending = None
        for host in self.hosts.values():
            if host.alive:
                host.row = dict(slot_map.get(host.name, {}))
                self.reconcile(host, now)

    # --- queues -----------------------------------------------------------------

    def serve(self, q: QueueSim, now: float, arriving: int) -> None:
        # Every queue, every step: attributes read once into locals.
        dt = self.dt
        if arriving:
            q.buckets.append([now, arriving])
            q.backlog += arriving
            q.arrived += arriving
        if q.redelivery:
            redeliver(q, now)
        active = q.active
        budget = active * dt
        owed = q.assigned - q.done_work
        if owed > EPS:
            if not active and q.draining:
                # Only stopped slots left: they finish the jobs they hold, and take no more.
                paid = min(q.draining * dt, owed)
                q.done_work += paid
                q.round_busy += paid * q.handler_share
                q.busy_seconds += paid
            elif budget > 0:
                paid = budget if budget < owed else owed
                q.done_work += paid
                budget -= paid
        if q.backlog and budget > EPS:
            budget = take(q, now, budget, self.dt)
        if q.inflight:
            settle(q)
        if q.backlog and q.held_batches < active:
            # Each free slot holds its next batch at the step's end (taken, not ready).
            take_batches(q, now, min(q.backlog, (active - q.held_batches)
                                     * q.policy.batch_size), 0, self.dt)
        settled = q.settled
        settled.append(q.finished)
        if len(settled) > self.settled_kept:
            settled.popleft()
        used = active * dt - budget
        q.round_busy += used * q.handler_share
        q.busy_seconds += used
        alive = q.existing * dt
        q.round_alive += alive
        q.slot_seconds += alive
        backlog = q.backlog
        if backlog > q.max_backlog:
            q.max_backlog = backlog
        watch_oldest(q, now + dt, dt, self.trace.interval_s)

    def end_round(self, q: QueueSim, index: int, now: float) -> None:
        """A round's end for one queue (bench/sim_vs_real.py samples the queues here)."""
        close_round(q, index, now, self.window_rounds, self.chunk, self.rounds - 1)

    # --- the loop -------------------------------------------------------------------

    def run(self, progress: Progress | None = None) -> PolicyRun:
        steps, dt = self.steps, self.dt
        self.host_events(0.0)
        self.start_running({name: spec.start_slots for name, spec in self.trace.queues.items()
                            if spec.start_slots})
        queues = list(self.queues.values())
        first_round = self.trace.first_round_s - EPS
        serve, end_round, settled_at = self.serve, self.end_round, self.settled_at
        for index in range(self.rounds):
            start = index * self.trace.interval_s
            self.host_events(start)
            if start >= first_round:
                self.plan_round(index, start)
            arriving = [q.arrivals.in_round(index) for q in queues]
            for step in range(steps):
                now = start + step * dt
                if step:
                    self.host_events(now)
                self.assign(now)
                if self.heap:
                    self.slot_events(now)
                if steps == 1:
                    for q, total in zip(queues, arriving, strict=True):
                        serve(q, now, total)
                else:
                    for q, total in zip(queues, arriving, strict=True):
                        serve(q, now, (total * (step + 1)) // steps - (total * step) // steps)
                settled_at.append(now + dt)
                if len(settled_at) > self.settled_kept:
                    settled_at.popleft()
            end = start + self.trace.interval_s
            for q in queues:
                end_round(q, index, end)
            if progress is not None:
                progress(self.policy.name, index + 1, self.rounds)
        reasons = self.policy.reasons if isinstance(self.policy, QclusterPolicy) else []
        return PolicyRun(self.policy.name, self.queues, reasons, self.deaths,
                         self.trace.interval_s, dt, self.detect_s, self.over_capacity,
                         self.rounds * self.trace.interval_s)


def simulate(trace: Trace, policies: Sequence[str] = POLICIES, seed: int = 0,
             progress: Progress | None = None) -> SimulationResult:
    """Every policy on the same arrivals (the same seed draws the same jobs)."""
    runs = {name: Simulation(trace, make_policy(name, trace), seed).run(progress)
            for name in policies}
    return SimulationResult(trace, seed, runs)
