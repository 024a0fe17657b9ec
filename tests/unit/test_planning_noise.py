"""The planner's edges leave room for the want's noise: hypothesis properties of the noise
estimate, the release and the backlog a busy slot normally holds."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from qcluster.manager.planning.plan import (
    QueueInput,
    QueuePlan,
    QueueWindow,
    Why,
    needed_slots,
    want_noise,
)
from qcluster.policy import QueuePolicy

TU = 0.8
ROUND_S = 2.0


def previous_plan(planned: int, work: float, spread: float = -1.0, low_rounds: int = 0,
                  low_peak: float = 0.0, low_jobs: int = 0) -> QueuePlan:
    return QueuePlan("q", planned, planned, planned, 0.5, 0.3, 0.05, Why(""), work=work,
                     spread=spread, low_rounds=low_rounds, low_peak=low_peak,
                     low_jobs=low_jobs, quiet_s=0.0)


@given(st.floats(0.001, 100.0), st.floats(-1.0, 10.0), st.floats(0.001, 2.0),
       st.integers(0, 100_000))
def test_the_noise_is_never_below_a_poisson_counts(work: float, spread: float, job_s: float,
                                                   processed: int) -> None:
    """However quiet the last rounds measured, the want's noise is at least what a Poisson
    count of the work's jobs makes of the smoothed estimate; a wider spread, more."""
    window = QueueWindow(processed=processed, recent_s=ROUND_S)
    noise = want_noise(work, spread, job_s, window, TU)
    per_round = work * ROUND_S / job_s
    poisson = math.sqrt(0.125 * work * work / max(per_round, 1.0)) / TU
    assert noise >= poisson * (1 - 1e-9)
    assert want_noise(work, max(spread, 0.0) + 1.0, job_s, window, TU) >= noise


@given(st.integers(1, 40), st.integers(0, 40), st.floats(0.0, 5.0), st.floats(0.0, 1.0),
       st.integers(0, 5_000), st.integers(0, 30), st.sampled_from([0, 5, 9]),
       st.sampled_from([None, 2.0, 30.0]))
def test_a_release_never_adds_slots(planned: int, arrived: int, low_peak: float,
                                    spread: float, low_jobs: int, low_rounds: int,
                                    priority: int, target_wait: float | None) -> None:
    """Below the band, a queue keeps or releases slots: the noise's margin may keep all of
    them, never add one (a 'release' from 3 to 4 slots was a flap)."""
    policy = QueuePolicy.model_validate({"priority": priority, "max_slots": 60,
                                         "target_wait": target_wait})
    work = arrived * 0.05 / ROUND_S
    window = QueueWindow(processed=arrived * 30, busy_s=arrived * 30 * 0.05,
                         alive_s=60.0 * planned, span_s=60.0, recent_s=ROUND_S,
                         recent_arrived=arrived)
    previous = previous_plan(planned, work, spread, low_rounds, low_peak, low_jobs)
    need = needed_slots(QueueInput("q", policy, planned, window, previous=previous), TU)
    if work / TU < planned * 0.5:  # well below the band, whatever the priority
        assert need.needed <= planned


@given(st.integers(1, 30), st.floats(0.01, 0.5), st.sampled_from([None, 2.0, 10.0, 60.0]),
       st.floats(0.0, 1.0))
def test_a_busy_slots_normal_queue_is_no_backlog_to_drain(planned: int, job_s: float,
                                                          target_wait: float | None,
                                                          share: float) -> None:
    """A backlog the planned slots start within half the horizon (at most a round, at most
    20 jobs a slot) is their queueing: the need is the one without it (no rise starts)."""
    policy = QueuePolicy.model_validate({"max_slots": 60, "target_wait": target_wait})
    horizon = min(60.0, target_wait or 60.0)
    within = math.floor(share * planned * min(horizon / 2, ROUND_S, 20 * job_s) / job_s)
    work = planned * TU
    arrived = round(work * ROUND_S / job_s)
    needs = []
    for backlog in (0, within):
        window = QueueWindow(processed=arrived * 30, busy_s=arrived * 30 * job_s,
                             alive_s=60.0 * planned, backlog=backlog, span_s=60.0,
                             recent_s=ROUND_S, recent_arrived=arrived)
        queue = QueueInput("q", policy, planned, window,
                           previous=previous_plan(planned, arrived * job_s / ROUND_S))
        need = needed_slots(queue, TU)
        needs.append((need.needed, need.high_rounds))
    assert needs[0] == needs[1]
