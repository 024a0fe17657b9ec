"""How many slots each queue needs: pure functions, no clock, no I/O.

For queue q over the window (``span`` seconds), with ``P`` jobs processed, ``T_busy``
handler seconds, ``T_alive`` slot-alive seconds and ``B`` ready jobs now:

* ``t = T_busy / P`` (the policy's estimate while nothing was measured),
* ``load = (T_busy + B * t) / T_alive`` — above 1 when work waits (the founding design's
  load, shown);
* the base is the **work arriving**, in slot-seconds per second: jobs that arrived since
  the previous round (counted by the caller, ``manager/planning/arrivals.py``) times ``t``, over
  the round's seconds, smoothed across rounds unless the count is beyond Poisson noise of
  the estimate and the count's margin (the jobs the reports may owe: then taken at once,
  a real change); the window's busy time over its span on the first round (a queue sized
  by its wait, below, smooths over at least about ``SIZED_SMOOTHING_JOBS`` jobs:
  :func:`sized_smoothing`);
* ``want = work / u + max(0, B * t - A) / H`` slots, ``u`` the manager's
  ``target_utilization`` or, for a queue sized by its wait (``size_by = "wait"``), the
  busiest utilization at most ``MAX_UTILIZATION`` at which its slots keep the predicted
  p99 wait within half its ``target_wait`` (``manager/planning/wait_sizing.py``; never
  more slots than ``target_utilization`` gives): such a queue is planned at ``u``
  throughout (its want, noise, edges, releases, idle slots), and its band's upper edge is
  the plan itself (the sized want is the most its slots may carry); where the backlog
  drains within ``H`` = the queue's ``target_wait`` (or 60 s, the founding design's
  default window), beyond ``A``: what the planned slots start within half of ``H`` (at
  most a round, at most 20 jobs a slot), a busy slot's normal queue, no need;
* hysteresis is anchored on the **previous plan**, not on the running count (which lags
  the plan while masters fork and drain): the plan is kept while ``want / plan`` stays
  within the priority's band (narrower for higher priorities: they react faster);
* the want's **noise** (:func:`want_noise`): the spread of the rounds' readings, measured
  (``Streak.spread``; the counts are noisier than Poisson), at least a Poisson count's;
* up: once ``want`` stayed above the band for two rounds (five while it is within one
  standard deviation of the noise above the edge) and the last move has landed (running
  == planned), to the least those rounds wanted; at once to ``ceil(want)`` when ``want``
  is beyond the band by far;
* down: only after ``want`` stayed below the band for ``hold_rounds(priority)`` rounds in
  a row (longer for higher priorities) over at least ``MIN_RELEASE_JOBS`` jobs (or
  ``MAX_HOLD_ROUNDS`` rounds), then to the fewest slots
  that keep the most those rounds wanted (but the first two, which still count part of
  the old rate) within half the band's upper side, and that plus three standard
  deviations of the noise within the upper side (a release that noise undoes is a flap);
* a queue with backlog and no measurement yet is planned like any other, at the policy's
  ``est_job_seconds``: its backlog drained within its horizon, not a slot per batch;
* a queue that had work within its ``idle_s`` keeps one warm slot (its next job waits for
  no fork), and a queue whose periodic tick is due within ``PREWARM_S`` (plus a round)
  gets one; ``min_slots`` stays the hard floor;
* when the cluster's capacity is short: minimums first in priority order, then every
  queue's real need in priority order, then the holds' **spare** in priority order. A
  hold's spare is what it keeps beyond what this round's arrivals need (with the band's
  room for noise) while nothing waits, and a warm or pre-warmed slot while nothing waits:
  a queue that waits takes it, whatever the priorities (many queues starting at once get
  their first slots instead of waiting for the holds of higher priorities to expire);
* work-conserving: the slots no need claims go, by priority, to backlogs worth more than
  ``IDLE_MIN_DRAIN_S`` of the slots their arrivals need (enough to drain them within
  ``IDLE_DRAIN_S``), while they last.

The previous round's :class:`QueuePlan` is the planner's only memory; the caller passes it
back in (``QueueInput.previous``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from qcluster.manager.planning.types import (
    STREAK_FIELDS,
    Need,
    QueueInput,
    QueuePlan,
    QueueWindow,
    Streak,
    Why,
)
from qcluster.manager.planning.wait_sizing import (
    MAX_UTILIZATION,
    predicted_p99_s,
    round_up,
    sized_utilization,
)
from qcluster.policy import QueuePolicy

__all__ = ["STREAK_FIELDS", "Need", "QueueInput", "QueuePlan", "QueueWindow", "Streak", "Why",
           "band_for", "hold_rounds", "mean_job_seconds", "needed_slots", "plan",
           "planned_utilization", "queue_load", "share_capacity", "use_idle", "work_rate"]

#: Band half-width at priority 0; each priority step narrows it, within the limits.
BASE_BAND = 0.30
BAND_STEP = 0.02
MIN_BAND = 0.10
MAX_BAND = 0.50
# The band's upper edge is capped so that slots never run busier than MAX_UTILIZATION
# (0.95): one constant with the sizing by wait's ceiling, imported from wait_sizing.py.
#: Beyond ``1 + FAR_BANDS * band`` the planner moves even while the last move is landing.
FAR_BANDS = 3.0
#: Rounds ``want`` must stay above the band (not far above) before slots are added: one
#: noisy round of arrivals does not move the plan.
UP_ROUNDS = 2
#: Rounds ``want`` must stay below the band before slots are released: the base, one more
#: per priority step (a high-priority queue keeps its slots for the next burst), the limits.
BASE_HOLD_ROUNDS = 5
MIN_HOLD_ROUNDS = 3
MAX_HOLD_ROUNDS = 30
#: The first rounds below the band still count part of the old rate (reports lag): their
#: want does not set where a release lands.
SETTLE_ROUNDS = 2
#: A want above the band's upper edge by less than this many standard deviations of its
#: round-to-round noise (want_noise) is within the noise: a steady rate near the edge
#: reads there now and then, and a slot added for that is released again (a flap) ...
UP_SIGMAS = 1.0
#: ... so it adds slots only after this many rounds in a row above the edge (a rising rate
#: is soon clear of the noise and waits UP_ROUNDS; waiting for it to clear the noise cost
#: diurnal.json's p99 wait a step).
NOISY_UP_ROUNDS = 5
#: A release lands where the most wanted plus this many standard deviations of the want's
#: round-to-round noise (want_noise) stays within the band's upper edge (and the most
#: wanted within half of it): the streak's rounds were all below the lower edge (their
#: peak reads low), and a release that the next rounds' noise undoes is a flap.
RELEASE_SIGMAS = 3.0
#: A release needs this many jobs counted below the band (fewer: the count is noise).
MIN_RELEASE_JOBS = 200
#: The arrival estimate: a round's count moves the running estimate by this share, unless it
#: is more than JUMP_SIGMAS Poisson deviations from it (the rate changed: take it at once).
SMOOTHING = 0.25
JUMP_SIGMAS = 4.0
#: ... and more than this many jobs away (a small count's Poisson tail is longer).
JUMP_MIN_JOBS = 5
#: A queue sized by its wait runs with little room above its plan, so its estimate must
#: be steadier: a round's count moves it by SMOOTHING, or by its jobs over this many when
#: fewer (the estimate spans at least about as many jobs), ...
SIZED_SMOOTHING_JOBS = 200.0
#: ... but at least by this share (memory of about 65 rounds; a change beyond the noise is
#: still taken at once). Rounds of 2-3 jobs (0.6 slot-s/s of 500 ms jobs) read up to
#: +60%: at SMOOTHING a 1-slot queue rose to 2 on that noise and its release's noise
#: margin never gave the slot back (diurnal_day.json's slack 0.275 -> 0.238).
MIN_SIZED_SMOOTHING = 0.03
#: The readings' spread (``Streak.spread``): a round's squared deviation moves it by this
#: share (about 20 rounds' memory) ...
SPREAD_SMOOTHING = 0.05
#: ... counted up to this many Poisson deviations of the count (further off is a change
#: of rate smoothed in, not noise: a fall's readings would hold its release back). The
#: counts spread up to about 6 times a Poisson count's variance (reports lag the broker).
SPREAD_SIGMAS = 3.0
#: Without a target_wait the backlog drains over this many seconds (the founding design's
#: load drains it over the window, 60 s by default).
DRAIN_S = 60.0
#: The backlog the planned slots start within this share of the horizon (at most a round,
#: and at most QUEUEING_JOBS of their jobs each) is their normal queue, not work to drain:
#: a slot 80-95% busy holds a few jobs, and a p99 of some 20. (Up to a whole round of
#: slot time added 14% to large_150x40.json's seconds over target at 10 s rounds.)
QUEUEING_SHARE = 0.5
QUEUEING_JOBS = 20.0
#: Idle slots (work-conserving): a backlog worth more than this many seconds of the slots
#: its arrivals need may take the slots no queue needs, by priority ...
IDLE_MIN_DRAIN_S = 10.0
#: ... as many as drain it within this (faster is not worth the forks), one per batch at
#: most, within max_slots, while the backlog lasts; then released by the usual hold.
IDLE_DRAIN_S = 5.0
#: ... and only when the slots they add (within the free ones) at least multiply the
#: queue's slots by this much.
IDLE_STEP = 1.5
#: The band's lower side, as a share of it. Half the band cut the diurnal day's slack
#: (0.333 -> 0.293 with shorter holds) but released slots within the flat phases of a
#: square wave, live and on steady.json: the whole band.
LOWER_SHARE = 1.0
#: A periodic queue's slot is started this long before its next tick (a fork and an
#: import), plus a round (the next round may come too late).
PREWARM_S = 5.0
#: A queue sized by its wait keeps its predicted p99 wait within this share of its
#: target_wait: the rest is room for a rising rate its estimate has not caught yet
#: (smoothed, a rise is taken after 2-5 rounds).
WAIT_SHARE = 0.5
#: A reason's basis (load, work, source, job time, horizon, want, target): in its Why, not nested.
BASIS = ("load {:.0%}, work {:.2f} slot-s/s ({}, {:.3g} ms/job) + backlog drain in {:g}s"
         " = {:.2f} slots at {:.0%}")
#: ... and for a queue sized by its wait (the basis, the p99 predicted at the slots its work
#: wants, the wait it is kept within, the utilization): nested.
SIZED = "{} (sized by wait: p99 ~{:.2g}s within {:g}s at {:.0%} busy)"


@functools.cache  # twice per queue per round, on a handful of priorities
def band_for(priority: int) -> float:
    """Tolerance around the target utilization; narrower for higher priority."""
    return min(MAX_BAND, max(MIN_BAND, BASE_BAND - BAND_STEP * priority))


def hold_rounds(priority: int) -> int:
    """Rounds below the band before slots are released; longer for higher priority."""
    return min(MAX_HOLD_ROUNDS, max(MIN_HOLD_ROUNDS, BASE_HOLD_ROUNDS + priority))


def mean_job_seconds(window: QueueWindow, policy: QueuePolicy) -> float:
    if window.processed > 0 and window.busy_s > 0:
        measured = window.busy_s / window.processed
        if measured > 0:  # not a float underflow
            return measured
    return policy.est_job_seconds


def queue_load(window: QueueWindow, policy: QueuePolicy) -> float:
    """(busy time + estimated backlog time) / slot time; inf when work waits and no slot ran."""
    return _load(window, mean_job_seconds(window, policy))


def _load(window: QueueWindow, job_s: float) -> float:
    """:func:`queue_load` at a mean job time already worked out."""
    work = window.busy_s + window.backlog * job_s
    if window.alive_s <= 0:
        return math.inf if work > 0 else 0.0
    return work / window.alive_s


def work_rate(queue: QueueInput, job_s: float) -> tuple[float, float, int, Why]:
    """Slot-seconds of work arriving per second, its readings' spread (``Streak.spread``),
    the jobs it was counted on, and where the figure comes from."""
    window, previous = queue.window, queue.previous
    if previous is not None and window.recent_s > 0:
        arrived = window.recent_arrived
        seen = (arrived, window.recent_s)  # "{} arrived in {:g}s"
        now = arrived * job_s / window.recent_s
        expected = previous.work * window.recent_s / job_s
        noise = JUMP_SIGMAS * math.sqrt(expected + 1) + JUMP_MIN_JOBS + window.recent_margin
        if abs(arrived - expected) > noise:
            # Beyond counting noise and the jobs the reports owed: the rate changed, take
            # it at once (the spread is of a steady rate's readings: kept as it was).
            return now, previous.spread, arrived, Why("{} arrived in {:g}s, a change", *seen)
        smoothing = (SMOOTHING if queue.policy.size_by != "wait"
                     else sized_smoothing(expected))
        smoothed = previous.work + smoothing * (now - previous.work)
        # A reading further off than SPREAD_SIGMAS Poisson deviations is a change of rate
        # smoothed in (a fall, a lagged report), not the noise of a steady one.
        square = min((now - previous.work) ** 2,
                     SPREAD_SIGMAS ** 2 * (expected + 1) * (job_s / window.recent_s) ** 2)
        spread = (square if previous.spread < 0
                  else previous.spread + SPREAD_SMOOTHING * (square - previous.spread))
        return smoothed, spread, arrived, Why("{} arrived in {:g}s, smoothed", *seen)
    if window.span_s > 0:
        busy = Why("busy {:.1f}s in {:g}s", window.busy_s, window.span_s)
        return window.busy_s / window.span_s, -1.0, window.processed, busy
    # No span known: the founding design's base, busy share of slot time times the running slots.
    share = window.busy_s / window.alive_s if window.alive_s > 0 else 0.0
    return share * queue.current, -1.0, window.processed, Why("busy {:.0%} of {} slots", share,
                                                              queue.current)


def sized_smoothing(jobs: float) -> float:
    """The share a round's count of ``jobs`` (expected) moves the arrival estimate of a
    queue sized by its wait by: SMOOTHING when a round counts SIZED_SMOOTHING_JOBS / 4
    jobs or more, less below, at least MIN_SIZED_SMOOTHING."""
    return min(SMOOTHING, max(MIN_SIZED_SMOOTHING, jobs / SIZED_SMOOTHING_JOBS))


def _clamp(value: int, policy: QueuePolicy) -> int:
    return max(policy.min_slots, min(policy.max_slots, value))


def needed_slots(queue: QueueInput, target_utilization: float) -> Need:
    """One queue's need, ignoring the other queues: what its work needs, and at least one
    warm slot while the queue had work within its ``idle_s`` or a periodic tick is due (that
    slot is spare while nothing waits)."""
    policy, window, previous = queue.policy, queue.window, queue.previous
    if queue.paused:
        return Need(0, queue_load(window, policy), "paused")
    if not queue.servable:
        return Need(0, queue_load(window, policy), "served by no live host")
    need, counted = _work_need(queue, target_utilization)
    busy = counted > 0 or window.backlog > 0
    if busy:
        quiet = 0.0
    else:
        quiet = previous.quiet_s + window.recent_s if previous is not None else math.inf
    tick = queue.next_tick_s
    floor, why = 0, need.why
    if quiet < policy.idle_s:
        floor, why = 1, Why("{}; warm: last job {:.0f}s ago, idle_s {:g}", why, quiet,
                            policy.idle_s)
    elif tick is not None and tick <= PREWARM_S + window.recent_s:
        floor, why = 1, Why("{}; periodic tick in {:.0f}s", why, tick)
    floor = min(floor, policy.max_slots)
    if need.needed >= floor:
        # The Need was just built for this round and is not shared yet: set in place
        # (dataclasses.replace costs about 10 us, every queue, every round).
        object.__setattr__(need, "quiet_s", quiet)
        return need
    spare = need.spare + (floor - need.needed if window.backlog == 0 else 0)
    return replace(need, needed=floor, why=why, spare=spare, quiet_s=quiet)


def planned_utilization(policy: QueuePolicy, work: float, job_s: float,
                        target_utilization: float) -> float:
    """The utilization a queue's slots are planned at: the manager's
    ``target_utilization``, or for a queue sized by its wait the busiest at which its
    slots keep the predicted p99 wait within WAIT_SHARE of its target_wait
    (:func:`~qcluster.manager.planning.wait_sizing.sized_utilization`)."""
    if policy.size_by != "wait" or policy.target_wait is None:
        return target_utilization
    if work >= MAX_UTILIZATION * policy.max_slots:  # clamped to max_slots whatever the wait
        return max(MAX_UTILIZATION, target_utilization)
    return sized_utilization(work, policy.batch_size * job_s, WAIT_SHARE * policy.target_wait,
                             target_utilization)


class _PredictedP99:
    """The p99 wait predicted at the slots the work wants, worked out only when a reason
    is read (a plan is made every round for every queue)."""

    __slots__ = ("job_s", "policy", "utilization", "work")

    def __init__(self, policy: QueuePolicy, work: float, job_s: float,
                 utilization: float) -> None:
        self.policy, self.work, self.job_s, self.utilization = policy, work, job_s, utilization

    def __format__(self, spec: str) -> str:
        servers = max(1, math.ceil(self.work / self.utilization - 1e-9))
        take_s = self.policy.batch_size * self.job_s
        return format(predicted_p99_s(servers, round_up(self.work), round_up(take_s)), spec)


def _sized_basis(policy: QueuePolicy, basis_args: tuple[object, ...], work: float,
                 job_s: float, utilization: float) -> Why:
    """The reason's basis for a queue sized by its wait: the p99 wait predicted at the
    slots its work wants, and the wait it is kept within."""
    wait = WAIT_SHARE * (policy.target_wait or 0.0)
    return Why(SIZED, Why(BASIS, *basis_args), _PredictedP99(policy, work, job_s, utilization),
               wait, utilization)


def _work_need(queue: QueueInput, target_utilization: float) -> tuple[Need, int]:
    """What the queue's work needs (arrivals at the target utilization, or the queue's
    own when it is sized by its wait; backlog drained within its horizon), with the
    hysteresis; and the jobs the arrivals were counted on. A queue with a backlog and
    nothing measured yet starts from the policy's ``est_job_seconds``, like any other."""
    policy, window, previous = queue.policy, queue.window, queue.previous
    anchor = _clamp(previous.planned if previous is not None else queue.current, policy)
    job_s = mean_job_seconds(window, policy)
    load = _load(window, job_s)
    work, spread, counted, source = work_rate(queue, job_s)
    sized = policy.size_by == "wait"
    utilization = (planned_utilization(policy, work, job_s, target_utilization) if sized
                   else target_utilization)
    horizon = min(DRAIN_S, policy.target_wait) if policy.target_wait else DRAIN_S
    # The backlog the planned slots start within QUEUEING_SHARE of the horizon (at most a
    # round, at most QUEUEING_JOBS jobs a slot) is their queueing, not a need: a queue
    # whose slots run busy holds a few jobs, and counting them would want a slot more at
    # its plan and none at one more (a flap).
    # Capped: a ratio over a sliver of slot time could be astronomically large.
    want = work / utilization
    if window.backlog:
        allowance = anchor * min(horizon * QUEUEING_SHARE, window.recent_s,
                                 QUEUEING_JOBS * job_s)
        want += max(0.0, window.backlog * job_s - allowance) / horizon
    want = min(want, policy.max_slots + 1.0)
    if anchor == 0 and counted == 0 and window.backlog == 0:
        # Nothing came and nothing waits: the smoothed estimate only decays towards 0 and
        # would bring a slot back 'by far' right after releasing the last one (a flap).
        want = 0.0
    band = band_for(policy.priority)
    basis = BASIS
    basis_args: tuple[object, ...] = (load, work, source, job_s * 1000, horizon, want,
                                      utilization)
    if sized:
        basis, basis_args = "{}", (_sized_basis(policy, basis_args, work, job_s, utilization),)
    ratio = want / anchor if anchor else (math.inf if want > 0 else 1.0)
    # The upper edge never lets the plan run its slots past MAX_UTILIZATION: above that,
    # work waits however wide the priority's band. A queue sized by its wait: the sized
    # want is the most its slots may carry (their predicted wait), the edge is the plan.
    # (Also when its wait needs all the slots the target utilization gives: the usual band
    # there and this edge just below made a 1-slot queue flap, 1 -> 2 -> 1 every minute.)
    upper = 1.0 if sized else min(1 + band, MAX_UTILIZATION / target_utilization)
    if ratio > upper:
        # (Far above, or no slot: up at once whatever the noise, not computed.)
        clear = anchor == 0 or ratio > 1 + FAR_BANDS * band or want - UP_SIGMAS * want_noise(
            work, spread, job_s, window, utilization, sized=sized) > anchor * upper
        above = Why(basis + " > {} +{:.0%}", *basis_args, anchor, upper - 1)
        return _up(queue, want, ratio, band, Need(anchor, load, above, work=work, spread=spread),
                   UP_ROUNDS if clear else NOISY_UP_ROUNDS), counted
    lower = band * LOWER_SHARE
    if ratio < 1 - lower and anchor > policy.min_slots:
        # Jobs a round would bring at the band's lower edge: a streak that should have
        # counted many of them and did not is evidence enough, however few it counted.
        edge_jobs = anchor * (1 - band) * utilization * window.recent_s / job_s
        below = Why(basis + " < {} -{:.0%}", *basis_args, anchor, lower)
        return _down(queue, want, counted, edge_jobs, upper,
                     Need(anchor, load, below, work=work, spread=spread),
                     job_s, utilization), counted
    return Need(anchor, load, Why(basis + " within {} -{:.0%}/+{:.0%}", *basis_args, anchor,
                                  lower, upper - 1), work=work, spread=spread), counted


def _up(queue: QueueInput, want: float, ratio: float, band: float, keep: Need,
        rounds: int) -> Need:
    """Above the band: up at once when far above, else after ``rounds`` rounds in a row
    (UP_ROUNDS, or NOISY_UP_ROUNDS within the want's noise; to the least any of them
    wanted) once the last move has landed."""
    previous, anchor = queue.previous, keep.needed
    streak = previous is not None and previous.high_rounds > 0
    high_rounds = (previous.high_rounds if streak and previous else 0) + 1
    floor = min(previous.high_floor if streak and previous else math.ceil(want),
                math.ceil(want))
    landed = previous is None or queue.current == previous.planned
    if ratio > 1 + FAR_BANDS * band or anchor == 0:
        return _moved(keep, _clamp(math.ceil(want), queue.policy), Why("{} by far", keep.why))
    if landed and high_rounds >= rounds:
        return _moved(keep, _clamp(max(floor, anchor + 1), queue.policy),
                      Why("{} for {} rounds, least wanted {}", keep.why, high_rounds, floor))
    wait = (Why("waiting for the last move to land ({} of {} running)", queue.current, anchor)
            if not landed else Why("{} of {} rounds", high_rounds, rounds))
    return Need(anchor, keep.load, Why("{}, {}", keep.why, wait), work=keep.work,
                spread=keep.spread, high_rounds=high_rounds, high_floor=floor)


def _moved(keep: Need, needed: int, why: Why) -> Need:
    """``keep`` (a need that only kept its anchor: no streak) moved to ``needed``: built
    directly, as ``dataclasses.replace`` would, at a fraction of its cost (every queue,
    every round)."""
    return Need(needed, keep.load, why, work=keep.work, spread=keep.spread)


def want_noise(work: float, spread: float, job_s: float, window: QueueWindow,
               target_utilization: float, *, sized: bool = False) -> float:
    """The standard deviation, in slots, of the want's reading on a steady rate of
    ``work``: the smoothed estimate's (SMOOTHING / 2 of the readings' ``spread``, which
    counts the estimate's own noise too; a Poisson count's while none was measured; for a
    queue ``sized`` by its wait, its own smoothing, :func:`sized_smoothing`) and the
    measured job time's (the window's jobs, as spread as exponential ones).
    ``target_utilization``: the queue's (:func:`planned_utilization`)."""
    if work <= 0 or job_s <= 0:
        return 0.0
    per_round = work * window.recent_s / job_s if window.recent_s > 0 else 0.0
    # Never less than a Poisson count's: a few quiet rounds measure less.
    spread = max(spread, work * work / max(per_round, 1.0))
    smoothing = sized_smoothing(per_round) if sized else SMOOTHING
    variance = smoothing / 2 * spread + work * work / max(window.processed, 1)
    return math.sqrt(variance) / target_utilization


def _down(queue: QueueInput, want: float, counted: int, edge_jobs: float, upper: float,
          keep: Need, job_s: float, target_utilization: float) -> Need:
    """Below the band: held for hold_rounds(priority) rounds in a row and until the streak
    is significant (it counted MIN_RELEASE_JOBS jobs, or the band's edge would have brought
    that many, or MAX_HOLD_ROUNDS passed), then down to the fewest slots that keep the
    most any round wanted (after the first SETTLE_ROUNDS) within half the upper band, and
    that plus RELEASE_SIGMAS times the want's noise (:func:`want_noise`, computed only
    then) within the upper band, at least one while any job came; never up."""
    previous = queue.previous
    streak = previous is not None and previous.low_rounds > 0
    low_rounds = (previous.low_rounds if streak and previous else 0) + 1
    # A round in which no job arrived and none waits wants nothing (the smoothed estimate
    # only decays towards 0).
    wanted = want if counted or queue.window.backlog else 0.0
    # The first rounds after a drop still count part of the old rate (reports lag): they
    # do not set where the release lands.
    if low_rounds <= SETTLE_ROUNDS:
        wanted = 0.0
    low_peak = max(previous.low_peak if streak and previous else 0.0, wanted)
    low_jobs = (previous.low_jobs if streak and previous else 0) + counted
    hold = hold_rounds(queue.policy.priority)
    landed = previous is None or queue.current == previous.planned
    enough = (max(low_jobs, edge_jobs * low_rounds) >= MIN_RELEASE_JOBS
              or low_rounds >= MAX_HOLD_ROUNDS)
    if low_rounds >= hold and enough and landed:
        # Not below what keeps the want within half the upper band: a release that the
        # next rounds' noise would undo is a flap.
        noise = want_noise(keep.work, keep.spread, job_s, queue.window, target_utilization,
                           sized=queue.policy.size_by == "wait")
        target = max(math.ceil(low_peak / (1 + (upper - 1) / 2) - 1e-9),
                     math.ceil((low_peak + RELEASE_SIGMAS * noise) / upper - 1e-9) if low_peak
                     else 0, 1 if low_jobs else 0)
        # A release never adds slots (the noise's margin may keep all of them).
        return _moved(keep, _clamp(min(target, keep.needed), queue.policy),
                      Why("{} for {} rounds, most wanted {:.2f}", keep.why, low_rounds, low_peak))
    # Nothing waits: the hold keeps what this round's arrivals need (with the band's room
    # for noise, none when nothing came); the rest of it is spare, and any queue's real
    # need ranks before it (share_capacity).
    keeps = keep.needed
    if not queue.window.backlog:
        now_wants = want * (1 + band_for(queue.policy.priority)) if counted else 0.0
        keeps = max(queue.policy.min_slots, math.ceil(now_wants - 1e-9))
    held = Why("{}, held {} of {} rounds", keep.why, low_rounds, hold)
    return Need(keep.needed, keep.load, held, spare=max(0, keep.needed - keeps), work=keep.work,
                spread=keep.spread, low_rounds=low_rounds, low_peak=low_peak, low_jobs=low_jobs)


def share_capacity(
    needs: Mapping[str, int], policies: Mapping[str, QueuePolicy], capacity: int,
    paused: frozenset[str] = frozenset(), spare: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """Minimums first in priority order, then the rest of each need in priority order,
    then the needs' ``spare`` slots (held beyond what the work needs) in priority order:
    a hold ranks below any queue's real need, whatever the priorities."""
    order = sorted(needs, key=lambda q: (-policies[q].priority, q))
    spare = spare or {}
    left = max(0, capacity)
    granted = dict.fromkeys(order, 0)
    for queue in order:
        floor = 0 if queue in paused else min(policies[queue].min_slots, needs[queue])
        floor = max(floor, 0)
        granted[queue] = min(floor, left)
        left -= granted[queue]
    # Every real need in priority order, then every hold's spare (``order`` is that order).
    parts = ([(q, needs[q] - spare.get(q, 0)) for q in order]
             + [(q, needs[q]) for q in order if spare.get(q)])
    for queue, upto in parts:
        more = min(upto - granted[queue], left)
        if more > 0:
            granted[queue] += more
            left -= more
    return granted


def use_idle(queues: Sequence[QueueInput], needs: Mapping[str, Need],
             granted: Mapping[str, int], capacity: int,
             target_utilization: float) -> dict[str, int]:
    """Work-conserving: the slots no queue needs go, by priority, to queues with a backlog
    worth more than IDLE_MIN_DRAIN_S of the slots their arrivals alone need: enough to
    drain it within IDLE_DRAIN_S on top of those arrivals, at most one per batch waiting,
    within max_slots.

    No flap: whether a backlog is worth idle slots does not depend on the slots planned,
    so a release the usual hold makes while it lasts is given back in the same round (the
    plan does not move), and once it is not the release stands."""
    free = capacity - sum(granted.values())
    extra: dict[str, int] = {}
    # Only the queues with a backlog are sorted (most have none, most rounds).
    waiting = [q for q in queues if q.window.backlog > 0 and q.servable and not q.paused]
    for queue in sorted(waiting, key=lambda q: (-q.policy.priority, q.name)):
        backlog, policy = queue.window.backlog, queue.policy
        job_s, work = mean_job_seconds(queue.window, policy), needs[queue.name].work
        arriving = work / planned_utilization(policy, work, job_s, target_utilization)
        backlog_s = backlog * job_s
        if not (math.isfinite(arriving) and math.isfinite(backlog_s)):
            continue
        if backlog_s <= IDLE_MIN_DRAIN_S * max(1, math.ceil(arriving)):
            continue
        have = granted[queue.name]
        wanted = min(math.ceil(arriving + backlog_s / IDLE_DRAIN_S), policy.max_slots,
                     have + math.ceil(backlog / policy.batch_size))
        more = min(free, wanted - have)
        if have + more < have * IDLE_STEP and have + more < policy.max_slots:
            # A backlog that grows while slots drain it slower than their job time says
            # (a loaded host), or the few slots free this round, would add a slot or two
            # every round: one move, or none. Up to max_slots is the last move, whatever
            # its size: a bigger backlog never gets fewer slots than a smaller one.
            continue
        if more > 0:
            extra[queue.name] = more
            free -= more
    return extra


def plan(
    queues: Sequence[QueueInput], capacity: int, target_utilization: float = 0.8
) -> dict[str, QueuePlan]:
    """Every queue's planned slots for this round, each with a reason."""
    needs = {queue.name: needed_slots(queue, target_utilization) for queue in queues}
    policies = {q.name: q.policy for q in queues}
    paused = frozenset(q.name for q in queues if q.paused)
    granted = share_capacity({n: need.needed for n, need in needs.items()}, policies, capacity,
                             paused, spare={n: need.spare for n, need in needs.items()})
    idle = use_idle(queues, needs, granted, capacity, target_utilization)
    plans = {}
    for queue in queues:
        need = needs[queue.name]
        got = granted[queue.name]
        why = need.why
        if got < need.needed - need.spare:
            why = Why("{}; capacity short: {} of {} needed", why, got, need.needed)
        elif got < need.needed:
            why = Why("{}; capacity short: {} spare of the hold to queues that wait", why,
                      need.needed - got)
        job_s = mean_job_seconds(queue.window, queue.policy)
        extra = idle.get(queue.name, 0)
        if extra:
            why = Why("{}; idle slots: +{} to drain the backlog ({:.0f} slot-s) in {:g}s", why,
                      extra, queue.window.backlog * job_s, IDLE_DRAIN_S)
            got += extra
        before = queue.previous.planned if queue.previous is not None else queue.current
        reason = Why("{}: {}, backlog {}, {} -> {} slots", queue.name, why,
                     queue.window.backlog, before, got)
        # The streak (STREAK_FIELDS) spelled out: a dict of getattr per queue and round
        # cost more than the rest of this loop.
        plans[queue.name] = QueuePlan(
            name=queue.name, current=queue.current, needed=max(need.needed, got), planned=got,
            load=need.load, band=band_for(queue.policy.priority), mean_job_s=job_s, why=reason,
            backlog=queue.window.backlog, spare=need.spare, work=need.work, spread=need.spread,
            low_rounds=need.low_rounds,
            low_peak=need.low_peak, low_jobs=need.low_jobs, high_rounds=need.high_rounds,
            high_floor=need.high_floor, quiet_s=need.quiet_s,
        )
    return plans
