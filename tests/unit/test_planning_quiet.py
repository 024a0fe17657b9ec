"""Quiet queues (idle_s, periodic pre-warm) and needs before holds: the planner's rules,
as hypothesis properties."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from qcluster.manager.planning.plan import PREWARM_S, QueueInput, QueuePlan, QueueWindow, Why, plan
from qcluster.manager.planning.rounds import RoundInput, next_ticks, with_ticks
from qcluster.periodic import periodic_spec
from qcluster.policy import QueuePolicy

TU = 0.8
BIG = 10_000


def policy_of(**fields: object) -> QueuePolicy:
    return QueuePolicy.model_validate(fields)


def quiet_round(policy: QueuePolicy, planned: int, quiet_s: float, recent_s: float = 2.0,
                next_tick_s: float | None = None) -> QueueInput:
    """A round in which nothing arrived and nothing waits, ``quiet_s`` seconds after the
    queue's last job, ``planned`` slots planned and running."""
    previous = QueuePlan("q", planned, planned, planned, 0.0, 0.3, 0.05, Why(""), work=0.0,
                         quiet_s=quiet_s, low_rounds=29)
    window = QueueWindow(processed=0, busy_s=0.0, alive_s=planned * 60.0, span_s=60.0,
                         recent_s=recent_s, recent_arrived=0)
    return QueueInput("q", policy, planned, window, previous=previous,
                      next_tick_s=next_tick_s)


@given(st.floats(0, 3_000), st.floats(0.1, 600), st.integers(0, 3))
def test_a_queue_keeps_a_warm_slot_within_idle_s_and_min_slots_stays_the_floor(
        quiet_s: float, idle_s: float, min_slots: int) -> None:
    policy = policy_of(idle_s=idle_s, min_slots=min_slots)
    got = plan([quiet_round(policy, 1 + min_slots, quiet_s)], BIG, TU)["q"]
    assert got.planned >= min_slots
    if quiet_s + 2.0 < idle_s:
        assert got.planned >= 1
        assert got.quiet_s == quiet_s + 2.0


def test_a_quiet_queue_goes_to_zero_once_idle_s_passed() -> None:
    """The warm slot is released by the usual hold once idle_s passed without a job."""
    policy = policy_of(idle_s=60.0)
    assert plan([quiet_round(policy, 1, 30.0)], BIG, TU)["q"].planned == 1
    assert plan([quiet_round(policy, 1, 300.0)], BIG, TU)["q"].planned == 0


def test_a_job_resets_the_quiet_clock() -> None:
    policy = policy_of(idle_s=60.0)
    queue = quiet_round(policy, 1, 500.0)
    busy = QueueInput("q", policy, 1, QueueWindow(processed=1, busy_s=0.05, alive_s=60.0,
                                                  span_s=60.0, recent_s=2.0, recent_arrived=1),
                      previous=queue.previous)
    assert plan([busy], BIG, TU)["q"].quiet_s == 0.0


@given(st.floats(0, 7_200), st.floats(1, 10))
def test_a_periodic_queue_gets_its_slot_just_before_its_tick(tick_s: float,
                                                             recent_s: float) -> None:
    policy = policy_of(idle_s=0.0)
    got = plan([quiet_round(policy, 0, 1e9, recent_s, tick_s)], BIG, TU)["q"]
    assert got.planned == (1 if tick_s <= PREWARM_S + recent_s else 0)
    assert plan([quiet_round(policy, 0, 1e9, recent_s)], BIG, TU)["q"].planned == 0


@given(st.integers(0, 20), st.integers(-5, 5), st.integers(1, 6))
def test_a_warm_slot_ranks_after_any_real_need(priority: int, other: int,
                                               capacity: int) -> None:
    """Whatever the priorities, a queue that waits takes a warm slot no job waits for."""
    warm = quiet_round(policy_of(priority=priority), 1, 10.0)
    waiting = QueueInput("w", policy_of(priority=other, est_job_seconds=1.0), 0,
                         QueueWindow(backlog=10_000))
    plans = plan([warm, waiting], capacity, TU)
    assert plans["w"].planned == capacity
    assert plans["q"].planned == 0
    assert sum(p.planned for p in plans.values()) <= capacity


def test_next_ticks_are_the_soonest_per_queue_and_reach_the_planner() -> None:
    specs = [periodic_spec("a", {"queue": "reports", "every": 60}, where="a"),
             periodic_spec("b", {"queue": "reports", "every": 3600}, where="b"),
             periodic_spec("c", {"queue": "cleanup", "cron": "0 * * * *"}, where="c")]
    ticks = next_ticks(specs, 3_600 * 1000 + 50.5)
    assert ticks == {"reports": 9.5, "cleanup": 3_600 - 50.5}
    queue = quiet_round(policy_of(idle_s=0.0), 0, 1e9)
    round_input = RoundInput(now=0.0, queues=(queue,), capacity={"h": 4},
                             serves={"h": frozenset()}, base={}, target_utilization=TU)
    assert with_ticks(round_input, {"q": 3.0}).queues[0].next_tick_s == 3.0
    assert with_ticks(round_input, {}).queues[0].next_tick_s is None
