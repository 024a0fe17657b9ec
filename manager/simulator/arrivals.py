"""Arrival counts per planning round and job-time sums, deterministic from a seed."""

from __future__ import annotations

import math
import random
from bisect import bisect_right

from qcluster.manager.simulator.trace import JobTime, QueueSpec

#: Above this mean a Poisson count is drawn from its normal approximation (fast, close).
POISSON_NORMAL_ABOVE = 50.0


def poisson(rng: random.Random, mean: float) -> int:
    if mean <= 0:
        return 0
    if mean > POISSON_NORMAL_ABOVE:
        return max(0, round(rng.gauss(mean, math.sqrt(mean))))
    limit, k, product = math.exp(-mean), 0, rng.random()
    while product > limit:
        k += 1
        product *= rng.random()
    return k


class RateCurve:
    """Jobs/s over time from ``rate`` points (step or linear), optionally periodic."""

    def __init__(self, spec: QueueSpec) -> None:
        self.times = [at for at, _ in spec.rate]
        self.rates = [r for _, r in spec.rate]
        self.linear = spec.shape == "linear"
        self.period = spec.period_s
        self.prefix = self._prefix()
        #: Jobs expected over a whole period: its end's rate is read at the next cycle's
        #: start (``at``), which the fast path of ``_within`` does not do.
        self.per_period = self._within(self.period, self.at(self.period)) if self.period else 0.0

    def at(self, t: float) -> float:
        if self.period:
            t = t % self.period
        i = bisect_right(self.times, t) - 1
        if i < 0:
            return 0.0
        if not self.linear or i + 1 >= len(self.times):
            return self.rates[i]
        t0, t1 = self.times[i], self.times[i + 1]
        return self.rates[i] + (self.rates[i + 1] - self.rates[i]) * (t - t0) / (t1 - t0)

    def jobs_between(self, start: float, end: float) -> float:
        """Expected jobs in [start, end): the rate's exact integral."""
        return self.cumulative(end) - self.cumulative(start)

    def cumulative(self, t: float) -> float:
        """Jobs expected from 0 to ``t``."""
        if self.period:
            cycles, t = divmod(t, self.period)
            return cycles * self.per_period + self._within(t)
        return self._within(t)

    def _within(self, t: float, end_rate: float | None = None) -> float:
        """Jobs expected from the period's start to ``t`` (within the period); the rate at
        ``t`` is ``at(t)``, worked out here from the same point (every queue, every round)
        unless given."""
        i = bisect_right(self.times, t) - 1
        if i < 0:
            return 0.0
        times, rates = self.times, self.rates
        t0 = times[i]
        if self.linear and i + 1 < len(times):
            if end_rate is None:  # at(t): t is within the period, the same point i
                end_rate = rates[i] + (rates[i + 1] - rates[i]) * (t - t0) / (times[i + 1] - t0)
            return self.prefix[i] + (rates[i] + end_rate) / 2 * (t - t0)
        return self.prefix[i] + rates[i] * (t - t0)

    def _prefix(self) -> list[float]:
        """Jobs expected from 0 to each point."""
        out, total = [], 0.0
        for i, t0 in enumerate(self.times):
            out.append(total)
            if i + 1 < len(self.times):
                t1 = self.times[i + 1]
                end_rate = self.rates[i + 1] if self.linear else self.rates[i]
                total += (self.rates[i] + end_rate) / 2 * (t1 - t0)
        return out


class Arrivals:
    """Jobs arriving in each planning round of one queue."""

    def __init__(self, spec: QueueSpec, seed: int, interval_s: float) -> None:
        self.spec, self.interval = spec, interval_s
        self.every_s = spec.every_s
        self.curve = RateCurve(spec)
        self.rng = random.Random(seed)
        self.carry = 0.0
        #: The previous round's end and the jobs expected up to it: rounds come in order,
        #: so a round's start is usually the previous one's end (the curve is pure).
        self.ended: tuple[float, float] = (math.nan, 0.0)

    def next_tick_s(self, now: float) -> float | None:
        """Seconds from ``now`` to the queue's next periodic tick (None: no periodic job)."""
        every = self.spec.every_s
        if every is None:
            return None
        return math.ceil(now / every - 1e-9) * every - now

    def ticks(self, start: float, end: float) -> int:
        """Periodic jobs enqueued in [start, end)."""
        every = self.spec.every_s
        if every is None:
            return 0
        ticks = math.ceil(end / every - 1e-9) - math.ceil(start / every - 1e-9)
        return ticks * self.spec.tick_jobs

    def in_round(self, index: int) -> int:
        if self.spec.per_round is not None:
            counts = self.spec.per_round
            return counts[index] if index < len(counts) else 0
        start = index * self.interval
        end = start + self.interval
        if self.every_s is None:  # most queues: no periodic job
            return self.from_rate(start, end)
        return self.ticks(start, end) + self.from_rate(start, end)

    def from_rate(self, start: float, end: float) -> int:
        """Jobs the rate brings in [start, end)."""
        ended_at, expected = self.ended
        before = expected if ended_at == start else self.curve.cumulative(start)
        upto = self.curve.cumulative(end)
        self.ended = (end, upto)
        mean = upto - before  # == self.curve.jobs_between(start, end)
        if self.spec.arrivals == "poisson":
            return poisson(self.rng, mean)
        self.carry += mean
        count = math.floor(self.carry + 1e-9)
        self.carry -= count
        return count


def peak_rate(spec: QueueSpec, interval_s: float) -> float:
    """The highest arrival rate of a queue (jobs/s), per round for exact counts."""
    if spec.per_round is not None:
        return max(spec.per_round, default=0) / interval_s
    return max((r for _, r in spec.rate), default=0.0)


class JobTimes:
    """Sums of job times: one draw per group of jobs started together."""

    def __init__(self, job_time: JobTime, seed: int) -> None:
        self.dist = job_time.dist
        self.mean_s = job_time.mean_s
        self.changes = sorted(job_time.changes)
        self.next_change = 0
        self.rng = random.Random(seed)

    def mean_at(self, t: float) -> float:
        while self.next_change < len(self.changes) and self.changes[self.next_change][0] <= t:
            self.mean_s = self.changes[self.next_change][1]
            self.next_change += 1
        return self.mean_s

    def total(self, jobs: int) -> float:
        """Seconds ``jobs`` jobs take together (a sum of exponentials is a gamma)."""
        if jobs <= 0:
            return 0.0
        if self.dist == "fixed":
            return jobs * self.mean_s
        return self.rng.gammavariate(jobs, self.mean_s)
