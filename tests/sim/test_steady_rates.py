"""A steady Poisson rate keeps its plan: the planner driven through the simulator at rates
near a whole slot count (where the want's noise crosses the band's edges), with and
without a ``target_wait``, at several priorities (their bands differ) and batch sizes.

A plan that rose on a few noisy rounds and fell back after its hold moved twice for
nothing, each move a fork or a drain on some host; at a narrow band (priority 9) or a
backlog term that counted a busy slot's normal queue, such a queue used to move every
half minute."""

from __future__ import annotations

import itertools
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from qcluster.manager.simulator import simulate
from qcluster.manager.simulator.trace import parse_trace

#: Plan moves while the first estimates settle are not churn.
WARM_UP_S = 120.0
DURATION_S = 1800.0
#: At most one plan move per queue per this many seconds after warm-up.
PER_S = 300.0
TARGET_UTILIZATION = 0.8


def plan_moves(rate: float, job_s: float, target_wait: float | None, priority: int,
               batch_size: int, seed: int,
               size_by: str = "utilization") -> list[tuple[float, int, int]]:
    """The plan moves after warm-up of one queue fed ``rate`` Poisson jobs a second."""
    policy: dict[str, object] = {"priority": priority, "max_slots": 60,
                                 "batch_size": batch_size, "size_by": size_by}
    if target_wait is not None:
        policy["target_wait"] = target_wait
    trace = parse_trace({
        "duration_s": DURATION_S, "hosts": {"h": {"slots": 64}},
        "queues": {"q": {"policy": policy, "rate": [[0, rate]],
                         "job_time": {"mean_s": job_s}}}})
    queue = simulate(trace, ("qcluster",), seed=seed).runs["qcluster"].queues["q"]
    return [move for move in queue.plan_moves if move[0] > WARM_UP_S]


def closest_moves_s(moves: list[tuple[float, int, int]]) -> float:
    return min((b[0] - a[0] for a, b in itertools.pairwise(moves)),
               default=math.inf)


@settings(max_examples=40, derandomize=True)
@given(st.integers(1, 12), st.sampled_from([-0.1, 0.0, 0.1]),
       st.sampled_from([0.01, 0.05, 0.2]), st.sampled_from([None, 2.0, 30.0]),
       st.sampled_from([0, 5, 9]), st.sampled_from([1, 10, 100]), st.integers(0, 10_000))
def test_a_steady_rate_near_a_whole_slot_count_moves_its_plan_at_most_once_per_5_minutes(
        whole: int, offset: float, job_s: float, target_wait: float | None, priority: int,
        batch_size: int, seed: int) -> None:
    """The rate needing ``whole + offset`` slots at the target utilization: after warm-up,
    at most one plan move per 5 minutes (in all: a rare run of Poisson counts a fifth
    above the rate for 20 s is a rise the plan may follow and leave)."""
    rate = (whole + offset) * TARGET_UTILIZATION / job_s
    moves = plan_moves(rate, job_s, target_wait, priority, batch_size, seed)
    assert len(moves) <= (DURATION_S - WARM_UP_S) // PER_S, (rate, job_s, target_wait, priority,
                                                             seed, moves)


def test_100_jobs_a_second_of_50_ms_never_moves_twice_within_5_minutes() -> None:
    """The rate the planner was seen to flap on with a target_wait (a move every 30 s)
    and its neighbours needing 4.9, 5.0 and 5.1 slots: no two moves within 5 minutes
    after warm-up, with or without a target_wait, at a wide and a narrow band."""
    for rate in (100.0, 78.4, 80.0, 81.6):
        for target_wait in (None, 2.0, 30.0):
            for priority in (0, 9):
                for seed in (0, 1, 2):
                    moves = plan_moves(rate, 0.05, target_wait, priority, 1, seed)
                    assert closest_moves_s(moves) >= PER_S, (rate, target_wait, priority,
                                                             seed, moves)


@settings(max_examples=40, derandomize=True)
@given(st.integers(1, 12), st.sampled_from([-0.1, 0.0, 0.1]),
       st.sampled_from([0.01, 0.05, 0.2]), st.sampled_from([2.0, 30.0]),
       st.sampled_from([0, 5, 9]), st.sampled_from([1, 10, 100]), st.integers(0, 10_000))
def test_a_steady_rate_sized_by_its_wait_moves_its_plan_at_most_once_per_5_minutes(
        whole: int, offset: float, job_s: float, target_wait: float, priority: int,
        batch_size: int, seed: int) -> None:
    """The same for a queue sized by its wait (its edge is the plan itself, its estimate
    steadier). Over the grid of docs/planner-measured.md (240 runs with a target_wait),
    2 runs moved twice within 5 minutes and 12 moves in all after warm-up, against 5 and
    51 sized by the target utilization."""
    rate = (whole + offset) * TARGET_UTILIZATION / job_s
    moves = plan_moves(rate, job_s, target_wait, priority, batch_size, seed, size_by="wait")
    assert len(moves) <= (DURATION_S - WARM_UP_S) // PER_S, (rate, job_s, target_wait, priority,
                                                             seed, moves)


def test_a_queue_sized_by_its_wait_whose_wait_needs_every_slot_does_not_flap() -> None:
    """16 jobs/s of 50 ms (0.8 slot-s/s) within 2 s: one slot keeps the predicted p99 wait
    within 1 s only below about 0.78 slot-s/s, so the sizing sits at the target
    utilization's count and the queue's utilization crosses it every few rounds. With the
    usual band at that count and the plan as the edge just below it, it moved 1 -> 2 -> 1
    about every minute (17-27 moves in 28 minutes); one edge for it keeps the plan."""
    for seed in range(5):
        moves = plan_moves(16.0, 0.05, 2.0, 0, 1, seed, size_by="wait")
        assert closest_moves_s(moves) >= PER_S, (seed, moves)
