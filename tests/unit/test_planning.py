"""The planner's properties (shared/DESIGN.md section 5), each a hypothesis test."""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import assume, given
from hypothesis import strategies as st

from qcluster.manager.planning.plan import (
    IDLE_MIN_DRAIN_S,
    MAX_UTILIZATION,
    QueueInput,
    QueuePlan,
    QueueWindow,
    Why,
    band_for,
    hold_rounds,
    plan,
)
from qcluster.policy import QueuePolicy

TU = 0.8


def make_policy(**fields: Any) -> QueuePolicy:
    """A validated policy (keywords checked at run time, as in qcluster.toml)."""
    return QueuePolicy.model_validate(fields)


@st.composite
def policies(draw: st.DrawFn) -> QueuePolicy:
    low = draw(st.integers(0, 5))
    high = draw(st.integers(low, low + 30))
    return make_policy(priority=draw(st.integers(-5, 20)), min_slots=low, max_slots=high,
                       batch_size=draw(st.sampled_from([1, 10, 100])),
                       est_job_seconds=draw(st.sampled_from([0.001, 0.05, 1.0])),
                       target_wait=draw(st.sampled_from([None, 0.5, 30.0])))


windows = st.builds(
    QueueWindow,
    processed=st.integers(0, 100_000),
    busy_s=st.floats(0, 500),
    alive_s=st.floats(0, 600),
    backlog=st.integers(0, 1_000_000),
)


@st.composite
def queue_inputs(draw: st.DrawFn, name: str = "q") -> QueueInput:
    policy = draw(policies())
    return QueueInput(name, policy, draw(st.integers(0, 40)), draw(windows))


BIG = 10_000


@given(queue_inputs())
def test_bounds_when_capacity_is_ample(queue: QueueInput) -> None:
    planned = plan([queue], BIG, TU)["q"].planned
    assert queue.policy.min_slots <= planned <= queue.policy.max_slots


@given(queue_inputs(), st.floats(-0.99, 0.99), st.integers(0, 40))
def test_hysteresis_keeps_the_plan_inside_the_band(queue: QueueInput, where: float,
                                                   running: int) -> None:
    """Inside the band the previous plan stands, whatever count is running meanwhile
    (the band's upper edge is capped so slots never run past 95% busy)."""
    policy = queue.policy
    n = max(1, policy.min_slots)
    assume(n <= policy.max_slots)
    band = band_for(policy.priority)
    edge = band if where < 0 else min(band, MAX_UTILIZATION / TU - 1)
    work = n * TU * (1 + where * edge)  # slot-seconds of work per second
    previous = QueuePlan("q", n, n, n, 0.5, band, 1.0, Why(""), work=work)
    window = QueueWindow(processed=round(work * 60), busy_s=work * 60.0, alive_s=n * 60.0,
                         backlog=0, span_s=60.0, recent_s=2.0, recent_arrived=round(work * 2))
    decision = plan([QueueInput("q", policy, running, window, previous=previous)], BIG, TU)
    assert decision["q"].planned == n


def test_higher_priority_has_a_narrower_band() -> None:
    assert band_for(10) < band_for(0) < band_for(-5)


@given(queue_inputs(), st.integers(1, 1_000_000))
def test_more_backlog_never_means_fewer_slots(queue: QueueInput, more: int) -> None:
    more_work = QueueInput("q", queue.policy, queue.current, QueueWindow(
        queue.window.processed, queue.window.busy_s, queue.window.alive_s,
        queue.window.backlog + more))
    assert plan([more_work], BIG, TU)["q"].planned >= plan([queue], BIG, TU)["q"].planned


@given(queue_inputs())
def test_idle_queue_shrinks_towards_its_minimum(queue: QueueInput) -> None:
    idle = QueueInput("q", queue.policy, queue.current,
                      QueueWindow(processed=0, busy_s=0.0, alive_s=60.0, backlog=0))
    planned = plan([idle], BIG, TU)["q"].planned
    assert planned == queue.policy.min_slots or planned <= queue.current
    assert planned >= queue.policy.min_slots


@given(st.lists(queue_inputs(), min_size=2, max_size=6), st.integers(0, 60))
def test_scarcity_serves_minimums_then_priority(queues: list[QueueInput], capacity: int) -> None:
    queues = [QueueInput(f"q{i}", q.policy, q.current, q.window) for i, q in enumerate(queues)]
    plans = plan(queues, capacity, TU)
    total = sum(p.planned for p in plans.values())
    assert total <= max(capacity, 0)
    by_name = {q.name: q for q in queues}
    for a in plans.values():
        for b in plans.values():
            pa, pb = by_name[a.name].policy, by_name[b.name].policy
            if pa.priority > pb.priority and b.planned > min(pb.min_slots, b.needed):
                # b got more than its minimum: a must have all it needed but its spare
                # (a hold or a warm slot no job waits for ranks after any real need).
                assert a.planned >= a.needed - a.spare
            if pa.priority > pb.priority and a.planned < min(pa.min_slots, a.needed):
                # a's minimum is not met: nothing was left for a lower priority.
                assert b.planned == 0
    if capacity >= sum(min(by_name[p.name].policy.min_slots, p.needed) for p in plans.values()):
        for p in plans.values():
            assert p.planned >= min(by_name[p.name].policy.min_slots, p.needed)


def test_backlog_without_measurements_needs_what_drains_it_within_its_target() -> None:
    """Nothing measured yet: the need is the backlog at ``est_job_seconds``, drained within
    target_wait (or 60 s), not a slot per batch up to max_slots; idle slots drain it faster
    only while no other queue needs them."""
    policy = make_policy(batch_size=1, max_slots=100, est_job_seconds=0.05, target_wait=10.0)
    queue = QueueInput("q", policy, 0, QueueWindow(backlog=600))
    alone = plan([queue], BIG, TU)["q"]
    assert alone.needed >= 3 and "backlog 600" in alone.reason  # 600 x 50 ms in 10 s
    # Needed 3 (30 slot-s within 10 s); the idle slots drain it within 5 s, no more.
    assert alone.planned == 6
    other = QueueInput("o", make_policy(priority=9, max_slots=100), 0,
                       QueueWindow(backlog=40_000))
    shared = plan([queue, other], 40, TU)
    # o needs 34 by priority; the 3 left would add under half of o's slots (IDLE_STEP):
    # they drain q's backlog.
    assert shared["q"].planned == 6 and shared["o"].planned == 34


def test_reason_carries_the_numbers() -> None:
    policy = make_policy(max_slots=50)
    window = QueueWindow(processed=1000, busy_s=100.0, alive_s=40.0, backlog=5000)
    decision = plan([QueueInput("mail", policy, 4, window)], BIG, TU)["mail"]
    assert decision.planned > 4
    assert decision.reason.startswith("mail: load ") and "backlog 5000" in decision.reason
    assert "4 -> " in decision.reason


def test_reason_reads_like_the_design_example() -> None:
    # Was: "> 104% (band ±30%)" (the seed's reason, whose numbers were not the decision's).
    policy = make_policy(max_slots=50)  # priority 0: band -30%, up edge capped at 95% busy
    window = QueueWindow(processed=1000, busy_s=100.0, alive_s=40.0, backlog=12000,
                         span_s=60.0)
    reason = plan([QueueInput("mail", policy, 4, window)], 23, TU)["mail"].reason
    assert reason.startswith("mail: load 3250%, work 1.67 slot-s/s (busy 100.0s in 60s")
    # 1.67 / 0.8 + 12000 jobs x 0.1 s / 60 s = 22.08 slots: the figure the move used.
    assert "= 22.08 slots at 80% > 4 +19% by far" in reason
    assert reason.endswith(", backlog 12000, 4 -> 23 slots")
    # With idle slots beside it, the backlog (1,200 slot-s, 52 s on 23 slots) takes them.
    reason = plan([QueueInput("mail", policy, 4, window)], 40, TU)["mail"].reason
    assert reason.endswith("; idle slots: +17 to drain the backlog (1200 slot-s) in 5s,"
                           " backlog 12000, 4 -> 40 slots")


def test_reason_names_the_move_the_log_shows() -> None:
    """The decision log shows previous plan -> new plan; the reason says the same."""
    policy = make_policy(max_slots=20)
    previous = QueuePlan("q", current=5, needed=8, planned=8, load=0.5, band=0.3,
                         mean_job_s=0.01, why=Why("earlier"), backlog=0, work=5.0)
    window = QueueWindow(processed=60_000, busy_s=600.0, alive_s=480.0, backlog=0,
                         span_s=60.0, recent_s=2.0, recent_arrived=1000)
    decision = plan([QueueInput("q", policy, 5, window, previous=previous)], BIG, TU)["q"]
    assert decision.reason.endswith(f", 8 -> {decision.planned} slots")


# --- the flapping fix (issue 14): each of these fails on the planner before it ------------

def steady(current: int, rate_jobs: int, job_s: float = 0.01) -> QueueWindow:
    """A window of a flat rate: ``rate_jobs`` per 2 s round, no backlog."""
    return QueueWindow(processed=rate_jobs * 30, busy_s=rate_jobs * 30 * job_s,
                       alive_s=max(current, 1) * 60.0, backlog=0, span_s=60.0, recent_s=2.0,
                       recent_arrived=rate_jobs)


def test_hysteresis_is_anchored_on_the_previous_plan_not_the_running_count() -> None:
    """8 planned, 5 running while the masters fork: a flat rate needing 8 keeps 8 (it was
    8 -> 5 -> 8 -> 5 in the demo)."""
    policy = make_policy(max_slots=16, priority=5)
    previous = None
    planned = []
    for current in (0, 5, 5, 6, 8, 8, 5, 8):  # masters lag, a host restarts slots
        # 1200 jobs of 10 ms per 2 s: 6 slot-seconds a second, 7.5 slots at 80%.
        window = steady(current, rate_jobs=1200, job_s=0.01)
        decision = plan([QueueInput("resize", policy, current, window, previous=previous)],
                        BIG, TU)["resize"]
        planned.append(decision.planned)
        previous = decision
    moves = sum(1 for a, b in itertools.pairwise(planned) if a != b)
    assert moves <= 1, planned


def test_base_is_work_per_second_not_the_count_times_a_ratio() -> None:
    """3 slot-seconds of work a second want 3 / 0.8 = 3.75 slots however many run (the
    seed's base, running count x load / target, wanted 3.75 from 1 and 45 from 12)."""
    policy = make_policy(max_slots=50)
    for running in (1, 2, 12):
        window = QueueWindow(processed=18_000, busy_s=180.0, alive_s=running * 60.0,
                             backlog=0, span_s=60.0)
        reason = plan([QueueInput("q", policy, running, window)], BIG, TU)["q"].reason
        assert "work 3.00 slot-s/s" in reason and "= 3.75 slots at 80%" in reason, reason


@given(st.integers(0, 10))
def test_release_waits_longer_for_higher_priority(priority: int) -> None:
    def rounds_to_release(prio: int) -> int:
        policy = make_policy(priority=prio, max_slots=20)
        previous = QueuePlan("q", 10, 10, 10, 0.5, band_for(prio), 0.01, Why(""), work=6.0)
        for rounds in range(1, 60):
            window = steady(10, rate_jobs=100)  # 0.5 slot-s/s: wants 1 slot
            previous = plan([QueueInput("q", policy, 10, window, previous=previous)],
                            BIG, TU)["q"]
            if previous.planned < 10:
                return rounds
        return 60

    assert rounds_to_release(priority) == hold_rounds(priority)
    assert hold_rounds(priority + 1) >= hold_rounds(priority)


def test_no_move_while_the_last_move_lands_unless_far() -> None:
    policy = make_policy(priority=0, max_slots=40)
    # 6 planned, already one round above the band: 1280 jobs of 10 ms per 2 s want 8.
    previous = QueuePlan("q", 2, 6, 6, 0.5, 0.3, 0.01, Why(""), work=6.4, high_rounds=1,
                         high_floor=8)
    landing = plan([QueueInput("q", policy, 3, steady(3, rate_jobs=1280), previous=previous)],
                   BIG, TU)["q"]
    assert landing.planned == 6 and "waiting for the last move to land (3 of 6" in landing.reason
    landed = plan([QueueInput("q", policy, 6, steady(6, rate_jobs=1280), previous=previous)],
                  BIG, TU)["q"]
    assert landed.planned == 8
    burst = QueueWindow(processed=36_000, busy_s=360.0, alive_s=180.0, backlog=200_000,
                        span_s=60.0, recent_s=2.0, recent_arrived=1000)
    far = plan([QueueInput("q", policy, 3, burst, previous=previous)], BIG, TU)["q"]
    assert far.planned > 8 and "by far" in far.reason


@given(st.integers(1, 5_000), st.sampled_from([0.001, 0.01, 0.1]),
       st.lists(st.integers(0, 3), min_size=20, max_size=20), st.integers(-5, 10))
def test_a_flat_rate_moves_the_plan_at_most_once(rate: int, job_s: float, lag: list[int],
                                                  priority: int) -> None:
    """Whatever the masters' lag (running = plan minus 0..3), a flat arrival rate settles
    the plan in at most one move after the first decision, and never flaps back."""
    assert_moves_once_at_a_flat_rate(make_policy(priority=priority, max_slots=100), rate,
                                     job_s, lag)


def assert_moves_once_at_a_flat_rate(policy: QueuePolicy, rate: int, job_s: float,
                                     lag: list[int]) -> None:
    """``rate`` jobs of ``job_s`` each round, running = the plan minus ``lag``'s rounds:
    at most one move after the first decision."""
    previous: QueuePlan | None = None
    planned = []
    for behind in lag:
        current = max(0, (previous.planned if previous else 0) - behind)
        window = QueueWindow(processed=rate * 30, busy_s=rate * 30 * job_s,
                             alive_s=max(current, 1) * 60.0, backlog=0, span_s=60.0,
                             recent_s=2.0, recent_arrived=rate)
        previous = plan([QueueInput("q", policy, current, window, previous=previous)],
                        BIG, TU)["q"]
        planned.append(previous.planned)
    moves = [(a, b) for a, b in itertools.pairwise(planned) if a != b]
    assert len(moves) <= 1, planned


@given(queue_inputs())
def test_paused_or_unservable_queue_gets_no_slot(queue: QueueInput) -> None:
    paused = QueueInput("q", queue.policy, queue.current, queue.window, paused=True)
    orphan = QueueInput("q", queue.policy, queue.current, queue.window, servable=False)
    assert plan([paused], BIG, TU)["q"].planned == 0
    decision = plan([orphan], BIG, TU)["q"]
    assert decision.planned == 0 and "served by no live host" in decision.reason


@given(st.lists(queue_inputs(), min_size=1, max_size=6), st.integers(0, 200))
def test_never_more_slots_than_the_cluster_has(queues: list[QueueInput], capacity: int) -> None:
    queues = [QueueInput(f"q{i}", q.policy, q.current, q.window) for i, q in enumerate(queues)]
    plans = plan(queues, capacity, TU)
    assert sum(p.planned for p in plans.values()) <= capacity
    for p in plans.values():
        assert 0 <= p.planned <= p.needed


def idle_round(queues: list[QueueInput], capacity: int) -> dict[str, QueuePlan]:
    return plan(queues, capacity, TU)


def ran(name: str, policy: QueuePolicy, slots: int, backlog: int, arrived: int,
           job_s: float = 0.02, previous: QueuePlan | None = None) -> QueueInput:
    """A queue that ran ``slots`` slots busy for a minute (jobs of ``job_s``), ``arrived``
    jobs in the last second."""
    work = arrived * job_s
    processed = round(max(slots, 1) * 60 / job_s)
    window = QueueWindow(processed=processed, busy_s=processed * job_s,
                         alive_s=max(slots, 1) * 60.0, backlog=backlog, span_s=60.0,
                         recent_s=1.0, recent_arrived=arrived)
    if previous is None:
        previous = QueuePlan(name, slots, slots, slots, 0.5, 0.3, job_s, Why(""),
                             backlog=backlog, work=work)
    return QueueInput(name, policy, slots, window, previous=previous)


def test_idle_slots_drain_a_backlog_by_priority_and_never_past_capacity() -> None:
    """Chaos row L2: b's backlog of 59 slot-s got 1 slot (its 60 s drain)
    while 3 of the host's 4 slots sat idle. Slots no queue needs now go to backlogs, the
    higher priority first, within max_slots and one per batch waiting."""
    low, high = make_policy(priority=0, batch_size=10), make_policy(priority=5, batch_size=10)
    plans = idle_round([ran("b", low, 1, 2950, 0), ran("c", high, 1, 600, 0)], 4)
    assert plans["c"].planned == 3  # 12 slot-s: 2 more drain it in 5 s... and 1 per batch
    assert plans["b"].planned == 1  # the last free slot went to c first
    assert sum(p.planned for p in plans.values()) == 4
    assert "idle slots: +2" in plans["c"].reason
    plans = idle_round([ran("b", low, 1, 2950, 0)], 4)
    assert plans["b"].planned == 4 and "idle slots: +3" in plans["b"].reason


def test_a_backlog_that_drains_soon_takes_no_idle_slot() -> None:
    policy = make_policy(batch_size=10)
    plans = idle_round([ran("b", policy, 2, 400, 0)], 8)  # 8 slot-s: 8 s on 1 slot
    assert plans["b"].planned == 2
    assert "idle" not in plans["b"].reason


def test_idle_slots_are_held_while_the_backlog_lasts_then_released_by_the_hold() -> None:
    """No flap: the extra slots stay while the backlog is worth them (a release the hold
    makes meanwhile is given back in the same round), and go with the usual hold after."""
    policy = make_policy(batch_size=10)
    queue = ran("b", policy, 1, 3000, 0)
    plans = idle_round([queue], 4)
    assert plans["b"].planned == 4
    history, backlog = [], 3000
    for _ in range(40):
        backlog = max(0, backlog - 200)  # 4 slots at 50 jobs/s each
        queue = ran("b", policy, 4, backlog, 0, previous=plans["b"])
        plans = idle_round([queue], 4)
        history.append((backlog, plans["b"].planned))
    # The backlog is worth idle slots while it is above IDLE_MIN_DRAIN_S of one slot's
    # work (500 jobs of 20 ms); from the first round below, the usual hold counts.
    light = next(i for i, (b, _) in enumerate(history) if b * 0.02 <= IDLE_MIN_DRAIN_S)
    planned = [p for _, p in history]
    assert all(p == 4 for p in planned[:light])
    assert planned[light + hold_rounds(0) - 1] < 4  # then released within the hold, once
    assert planned == sorted(planned, reverse=True)  # never back up: no flap


def test_a_queue_released_to_zero_stays_there_while_nothing_comes() -> None:
    """The smoothed work estimate only decays towards 0: at 0 slots any of it was 'far
    above' the band, so an idle queue went 1 -> 0 -> 1 -> 0 (seen in the simulator)."""
    policy = make_policy()
    previous = QueuePlan("q", 0, 0, 0, 0.0, 0.3, 0.02, Why(""), backlog=0, work=1e-4)
    window = QueueWindow(processed=10, busy_s=0.2, alive_s=30.0, backlog=0, span_s=60.0,
                         recent_s=1.0, recent_arrived=0)
    assert plan([QueueInput("q", policy, 0, window, previous=previous)], 8, TU)["q"].planned == 0


def held(name: str, policy: QueuePolicy, slots: int, arrived: int, work: float = 2.0,
         backlog: int = 0) -> QueueInput:
    """A queue that ran ``slots`` slots on ``work`` slot-s/s and now counted ``arrived``
    jobs (20 ms) in a second: below its band, in its hold."""
    previous = QueuePlan(name, slots, slots, slots, 0.6, 0.3, 0.02, Why(""), work=work)
    return ran(name, policy, slots, backlog, arrived, previous=previous)


def test_a_held_queue_with_nothing_to_do_lends_its_slots_to_a_queue_that_waits() -> None:
    """Chaos row L2 scarce: on a host of 4 slots a's arrivals (3 slots' worth) moved to
    b; a held its 3 slots for its hold rounds (nothing arrived, nothing waits) while b ran
    on the 1 left. Now a's spare goes to b at once; a keeps the slot no one waits for."""
    policy = make_policy(batch_size=10)
    plans = plan([held("a", policy, 3, 0), ran("b", policy, 1, 200, 100)], 4, TU)
    assert plans["b"].planned == 3
    assert plans["a"].planned == 1
    assert "2 spare of the hold to queues that wait" in plans["a"].reason
    assert plans["a"].low_rounds == 1  # a's hold goes on for what it keeps


def test_a_hold_keeps_what_its_arrivals_need_and_lends_the_rest_to_a_queue_that_waits() -> None:
    """A held queue with nothing waiting keeps the slots this round's arrivals need (with
    its band's room for noise); the rest of the hold is spare and goes to a queue that
    waits. A hold with jobs waiting is no spare, nor one no queue waits for, nor the
    minimum."""
    policy = make_policy(batch_size=10)
    # a: 50 jobs of 20 ms in 1 s = 1 slot-s/s, 1.25 slots at 80%, 1.6 with the band: 2.
    plans = plan([held("a", policy, 4, 50), ran("b", policy, 1, 200, 100)], 5, TU)
    assert (plans["a"].planned, plans["b"].planned) == (2, 3)
    plans = plan([held("a", policy, 3, 0, backlog=5), ran("b", policy, 1, 200, 100)], 4, TU)
    assert (plans["a"].planned, plans["b"].planned) == (3, 1)
    plans = plan([held("a", policy, 3, 0), ran("b", policy, 1, 0, 40)], 4, TU)
    assert (plans["a"].planned, plans["b"].planned) == (3, 1)
    floor = make_policy(batch_size=10, min_slots=2)
    plans = plan([held("a", floor, 3, 0), ran("b", policy, 1, 200, 100)], 4, TU)
    assert (plans["a"].planned, plans["b"].planned) == (2, 2)


def test_any_real_need_ranks_before_any_hold_whatever_the_priorities() -> None:
    """A cold start of many queues: a high-priority queue's hold (nothing waits for it)
    must not keep a lower priority's first slots from it."""
    low, high = make_policy(priority=0, batch_size=10), make_policy(priority=5, batch_size=10)
    plans = plan([held("a", high, 3, 0), ran("b", low, 1, 200, 100)], 4, TU)
    assert (plans["a"].planned, plans["b"].planned) == (1, 3)
    plans = plan([held("a", low, 3, 0), ran("b", high, 1, 200, 100)], 4, TU)
    assert (plans["a"].planned, plans["b"].planned) == (1, 3)
    plans = plan([held("z", low, 3, 0), ran("b", low, 1, 200, 100)], 4, TU)
    assert (plans["z"].planned, plans["b"].planned) == (1, 3)
    # Real needs among themselves still go by priority.
    plans = plan([ran("a", high, 1, 2000, 200), ran("b", low, 1, 2000, 200)], 4, TU)
    assert (plans["a"].planned, plans["b"].planned) == (4, 0)
