"""A queue's batches in the simulation: taken first in, first out (each job's wait ends
at its take), settled one by one as its slots work through them, and given back when their
host dies (lock-expiry redelivery). Functions of one queue's state (``QueueSim``); ``dt``
is the simulation step, the resolution of the waits."""

from __future__ import annotations

import math
from typing import Any

from qcluster.manager.simulator.model import QueueSim

EPS = 1e-9


def lose(q: QueueSim, now: float, jobs: int, dt: float) -> None:
    """A dead host held ``jobs`` of the queue's jobs (its slots' batches, the latest
    taken): they come back to the queue when their locks expire (``lock_timeout``),
    ahead of the jobs waiting then, and wait again (their first take no longer counts);
    the work its slots did on them is lost."""
    lost: list[list[Any]] = []
    while jobs and q.inflight:
        end, count = q.inflight[-1]
        batches, taken_at, parts = q.taken[-1]
        begin = max(q.inflight[-2][0] if len(q.inflight) > 1 else q.done_work,
                    q.done_work)
        take = min(jobs, count)
        if take == count:
            q.inflight.pop()
            q.taken.pop()
            q.held_batches -= batches
            q.assigned = begin
        else:
            kept = max(1, round(batches * (count - take) / count))
            q.inflight[-1] = [begin + (end - begin) * (count - take) / count, count - take]
            q.taken[-1][0] = kept
            q.held_batches -= batches - kept
            q.assigned = q.inflight[-1][0]
        jobs -= take
        while take:  # the latest taken of the entry's jobs
            part = parts[-1]
            n = min(take, part[1])
            q.waits[round((taken_at - part[0]) / dt)] -= n
            lost.append([part[0], n])
            part[1] -= n
            take -= n
            q.started -= n
            q.locked_lost += n
            if not part[1]:
                parts.pop()
    if lost:
        lost.sort(key=lambda part: part[0])
        q.redelivery.append([now + q.policy.lock_timeout, lost])


def redeliver(q: QueueSim, now: float) -> None:
    while q.redelivery and q.redelivery[0][0] <= now + EPS:
        for enqueued, jobs in reversed(q.redelivery.popleft()[1]):
            q.buckets.appendleft([enqueued, jobs])
            q.backlog += jobs
            q.locked_lost -= jobs
            q.redelivered += jobs


def settle_part(q: QueueSim) -> None:
    """The first entry's batches the slots have worked through settle (a slot settles
    each batch as it ends it), not all at its end: the broker's locked set holds only
    the batches not ended yet. Its batches are even shares of its work."""
    entry, held = q.inflight[0], q.taken[0]
    end, count = entry
    batches, begin = held[0], q.settled_work
    if end - begin <= EPS:
        return
    ended = math.floor(batches * (q.done_work - begin) / (end - begin) + EPS)
    if ended <= 0:
        return
    kept = batches - ended
    left = round(count * kept / batches)
    entry[1], held[0] = left, kept
    q.held_batches -= ended
    q.settled_work = begin + (end - begin) * ended / batches
    q.finished += count - left
    q.round_processed += count - left


def take(q: QueueSim, now: float, budget: float, dt: float) -> float:
    """The queue's slots take batches for ``budget`` seconds of work: as many as their
    spare time allows (a slot takes what is ready when it is free, up to
    ``batch_size``: batches of one when the slots keep up, full ones when they do
    not), each paying ``batch_cost_s`` beyond its jobs' handler time. Returns the
    budget left."""
    mean = q.job_times.mean_at(now)
    size, cost = q.policy.batch_size, q.batch_cost_s
    while q.backlog and budget > EPS:
        ready = q.backlog
        if -(-ready // size) * cost + ready * mean >= budget:  # more than it can do
            full = size * mean + cost
            jobs = min(ready, size * max(1, math.ceil(budget / full - EPS)))
            batches = -(-jobs // size)
        else:  # all of it, in as many batches as the slots' spare time allows
            jobs = ready
            most = math.floor((budget - ready * mean) / cost) if cost else q.active
            batches = max(-(-jobs // size), min(jobs, most))
        work = take_batches(q, now, jobs, batches, dt)
        paid = min(budget, work)
        q.done_work += paid
        budget -= paid
    return budget


def take_batches(q: QueueSim, now: float, jobs: int, batches: int, dt: float) -> float:
    """Take the first ``jobs`` ready jobs (first in, first out) in ``batches`` batches
    (0: full ones); their work. Each job's wait ends here."""
    if not batches:
        batches = -(-jobs // q.policy.batch_size)
    q.backlog -= jobs
    q.started += jobs
    buckets, waits = q.buckets, q.waits
    parts = []  # [[enqueued at, jobs], ...]: where they came from
    left = jobs
    while left:
        bucket = buckets[0]
        take = bucket[1] if bucket[1] < left else left
        waits[round((now - bucket[0]) / dt)] += take
        parts.append([bucket[0], take])
        bucket[1] -= take
        left -= take
        if not bucket[1]:
            buckets.popleft()
    handler = q.job_times.total(jobs)
    work = handler + batches * q.batch_cost_s
    if work > 0:
        q.handler_share = handler / work
    begin = q.assigned
    if not q.inflight:
        q.settled_work = begin
    q.assigned += work
    if batches > 1:  # the last batch apart: the others settle before it
        last = jobs - (jobs * (batches - 1)) // batches
        # Both share ``parts``: a loss takes the latest jobs first, from its end.
        q.inflight.append([begin + work * (batches - 1) / batches, jobs - last])
        q.taken.append([batches - 1, now, parts])
        q.inflight.append([q.assigned, last])
        q.taken.append([1, now, parts])
    else:
        q.inflight.append([q.assigned, jobs])
        q.taken.append([batches, now, parts])
    q.held_batches += batches
    return work


def settle(q: QueueSim) -> None:
    """Settle the entries the slots have worked through, then the ended batches of the
    next (settle_part)."""
    inflight = q.inflight
    done = q.done_work + EPS
    if inflight[0][0] <= done:
        taken = q.taken
        finished = 0
        while inflight and inflight[0][0] <= done:
            q.settled_work, count = inflight.popleft()
            finished += count
            q.held_batches -= taken.popleft()[0]
        q.finished += finished
        q.round_processed += finished
    if inflight and q.taken[0][0] > 1 and q.done_work > q.settled_work + EPS:
        settle_part(q)


def watch_oldest(q: QueueSim, end: float, dt: float, interval_s: float) -> None:
    """Time over target and bursts, from the oldest waiting job's age at ``end`` (the
    step's end), as the manager's watch sees it."""
    age = end - q.buckets[0][0] if q.buckets else 0.0
    target = q.policy.target_wait
    if target is not None and age > target + EPS:
        q.over_target_s += dt
        q.over_target_at.append(end)
    if age > interval_s + EPS:
        if q.burst_from is None:
            q.burst_from = end - age
    elif q.burst_from is not None and q.backlog == 0:
        q.bursts.append(end - q.burst_from)
        q.burst_from = None
