"""Sizing a queue by its wait (``size_by = "wait"``): the M/M/c prediction. Pure.

A queue sized by its wait is planned at its own utilization instead of the manager's
``target_utilization``: the busiest, at most ``MAX_UTILIZATION``, at which the slots that
carry its work keep the predicted 99th percentile of its wait within ``wait_s`` (the
planner passes half the queue's ``target_wait``); never more slots than
``target_utilization`` gives.

The model is M/M/c (Poisson arrivals, exponential service, ``c`` servers). A **server is
a slot**, and its unit of service is a **take**: a slot takes up to ``batch_size`` ready
jobs at once and runs them one after the other, so a take of full batches lasts
``take_s = batch_size * job_s`` and takes arrive ``batch_size`` times less often. The
offered load ``a`` (slot-seconds of work per second, the planner's ``work``) is the same
as per job; the wait scales with a take's time (a job that finds every slot busy waits
for one to end its take). Full takes are the worst case (slots that keep up take batches
of one), so the model errs towards more slots. With Erlang's C formula ``C(c, a)``, the
chance that a job waits at all::

    P(wait > x) = C(c, a) * exp(-(c - a) * x / take_s)
    p99 wait    = take_s * ln(C(c, a) / 0.01) / (c - a)       (0 when C(c, a) <= 0.01)

The slots are a real number, so that the planner's band and its noise work on them as on
a utilization's want: between whole slots the inverse of the p99 wait is interpolated
linearly (and it is 0 at ``c = a``, where the wait has no bound), so the fewest slots grow
smoothly with the work, and their ceiling is the fewest whole slots whose p99 is within
``wait_s``.

Cheap: the fewest slots are cached on the work and the take's time rounded up to
``SIGNIFICANT_DIGITS`` (a few hundred values per queue over a day; a rounded-up input asks
for a hair more slots, never fewer).
"""

from __future__ import annotations

import functools
import math

#: Slots never run busier than this (the planner's band caps at the same).
MAX_UTILIZATION = 0.95
#: The quantile of the wait kept within the target: its tail is this share of the jobs.
TAIL = 0.01
#: The cache's inputs (work, a take's seconds) are rounded up to this many significant
#: digits: at most 1% more, a few hundred keys per queue over a day.
SIGNIFICANT_DIGITS = 3
#: Entries kept in each cache: about 150 queues' day at the rounding above.
CACHE_SIZE = 16_384


def erlang_c(servers: int, load: float) -> float:
    """The chance that a job waits (Erlang's C formula) at ``servers`` servers carrying
    ``load`` (in servers); 1 when the load reaches the servers (the queue has no bound)."""
    if load <= 0:
        return 0.0
    if load >= servers:
        return 1.0
    blocking = 1.0  # Erlang's B formula, by its stable recursion over the servers
    for k in range(1, servers + 1):
        blocking = load * blocking / (k + load * blocking)
    return _c_from_b(servers, load, blocking)


def _c_from_b(servers: int, load: float, blocking: float) -> float:
    return servers * blocking / (servers - load * (1.0 - blocking))


def p99_wait_s(servers: int, load: float, take_s: float) -> float:
    """The M/M/c prediction of the 99th percentile of the wait, in seconds (inf when the
    load reaches the servers)."""
    if load <= 0:
        return 0.0
    if load >= servers:
        return math.inf
    return _quantile(erlang_c(servers, load), servers, load, take_s)


def _quantile(waits: float, servers: int, load: float, take_s: float) -> float:
    """The wait only ``TAIL`` of the jobs exceed, given the chance ``waits`` of any wait."""
    if waits <= TAIL:
        return 0.0
    return take_s * math.log(waits / TAIL) / (servers - load)


def round_up(value: float) -> float:
    """``value`` rounded up to SIGNIFICANT_DIGITS (non-decreasing in ``value``; a value
    already rounded stays as it is, within float error)."""
    if value <= 0:
        return 0.0
    scale = 10.0 ** (math.floor(math.log10(value)) - SIGNIFICANT_DIGITS + 1)
    return math.ceil(value / scale - 1e-9) * scale


def sized_slots(work: float, take_s: float, wait_s: float, target_utilization: float) -> float:
    """The fewest slots, as a real number, that carry ``work`` slot-seconds per second
    with the predicted p99 wait within ``wait_s``: at least ``work / MAX_UTILIZATION``, at
    most ``work / target_utilization``. Non-decreasing in ``work`` and ``take_s``,
    non-increasing in ``wait_s``."""
    if work <= 0:
        return 0.0
    most = work / target_utilization
    least = work / MAX_UTILIZATION
    if most <= least:
        return most
    fewest = _fewest_slots(round_up(work), round_up(take_s), wait_s, math.ceil(most))
    return min(most, max(least, fewest))


@functools.lru_cache(maxsize=CACHE_SIZE)
def _fewest_slots(load: float, take_s: float, wait_s: float, most: int) -> float:
    """Where the interpolated inverse p99 wait reaches ``1 / wait_s``, from ``c = load``
    (where it is 0) on; inf when ``most`` whole slots do not reach it."""
    goal = 1.0 / wait_s
    at, speed = load, 0.0  # the previous point: (slots, 1 / p99 wait)
    blocking = 1.0
    for servers in range(1, most + 1):
        blocking = load * blocking / (servers + load * blocking)
        if servers <= load:
            continue
        p99 = _quantile(_c_from_b(servers, load, blocking), servers, load, take_s)
        reach = math.inf if p99 <= 0 else 1.0 / p99
        if reach >= goal:
            if math.isinf(reach):
                return at
            return at + (servers - at) * (goal - speed) / (reach - speed)
        at, speed = float(servers), reach
    return math.inf


def sized_utilization(work: float, take_s: float, wait_s: float,
                      target_utilization: float) -> float:
    """The utilization :func:`sized_slots` plans ``work`` at (MAX_UTILIZATION, or
    ``target_utilization`` if that is busier, when there is no work)."""
    slots = sized_slots(work, take_s, wait_s, target_utilization)
    if slots <= 0:
        return max(MAX_UTILIZATION, target_utilization)
    # At either bound, the bound itself: work / it is then exactly its slots.
    if slots >= work / target_utilization:
        return target_utilization
    if slots <= work / MAX_UTILIZATION:
        return MAX_UTILIZATION
    return work / slots


@functools.lru_cache(maxsize=CACHE_SIZE)
def predicted_p99_s(servers: int, load: float, take_s: float) -> float:
    """:func:`p99_wait_s`, cached (the planner's reason shows it; pass rounded inputs)."""
    return p99_wait_s(servers, load, take_s)
