"""How bench/sim_vs_real measures a queue from round samples, the same on both sides:
FIFO waits from the cumulative curves, slot-seconds and slot moves from the slots each
round saw, and the simulation sampled where the recording samples the cluster."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.sim_vs_real import Rounds, SampledSimulation, fifo_waits, figures_of
from qcluster.manager.simulator.policies import make_policy
from qcluster.manager.simulator.trace import parse_trace


def rounds(arrived: list[int], backlog: list[int], slots: list[int] | None = None) -> Rounds:
    out = Rounds()
    for a, b, s in zip(arrived, backlog, slots or [1] * len(arrived), strict=True):
        out.add(s, b, a)
    return out


def test_nothing_ready_at_any_round_is_no_wait() -> None:
    assert set(fifo_waits(rounds([100] * 10, [0] * 10), 2.0)) == {0.0}


def test_a_rounds_arrivals_ready_at_the_next_round_waited_one_round() -> None:
    """Each round's 100 jobs are all still ready at its end and gone by the next: every job
    waited one interval (taken in the order they came, at the rate they came), but the
    last two rounds' (the last round took both)."""
    waits = fifo_waits(rounds([100] * 10, [100] * 9 + [0]), 2.0)
    assert waits[:800] == pytest.approx([2.0] * 800)
    assert all(w < 2.0 for w in waits[801:])


def test_a_job_never_taken_waits_until_the_end() -> None:
    waits = fifo_waits(rounds([10, 0, 0], [10, 10, 10]), 2.0)
    assert max(waits) <= 6.0 and min(waits) >= 4.0


@given(st.lists(st.tuples(st.integers(0, 500), st.integers(0, 500)), min_size=1, max_size=30))
def test_waits_are_never_negative_and_the_mean_is_littles_law(pairs: list[tuple[int, int]]) -> None:
    arrived = [a for a, _ in pairs]
    total, backlog = 0, []
    for a, b in pairs:  # a backlog no larger than the jobs arrived so far
        total += a
        backlog.append(min(b, total))
    waits = fifo_waits(rounds(arrived, backlog), 1.0, points=10_000_000)
    assert all(w >= 0 for w in waits)
    assert len(waits) == sum(arrived)


def test_slot_seconds_and_moves_are_counted_from_the_rounds() -> None:
    fig = figures_of(rounds([0] * 5, [0] * 5, [1, 4, 4, 1, 2]), 2.0)
    assert fig["slot_seconds"] == 24.0
    assert fig["slot_moves"] == 3 + 3 + 1


def test_the_simulation_reports_slots_as_a_master_does_before_acting_on_a_plan() -> None:
    """A queue fed from 10 s on gets slots planned at the round after; the round that
    plans them cannot see them (its report was sent before), the next one does."""
    trace = parse_trace({"duration_s": 30, "hosts": {"a": {"slots": 8}},
                         "queues": {"q": {"policy": {"max_slots": 4},
                                          "rate": [[10, 200]], "arrivals": "even",
                                          "job_time": {"dist": "fixed", "mean_s": 0.01}}}})
    sim = SampledSimulation(trace, make_policy("qcluster", trace), 0)
    sim.run()
    slots = sim.sampled["q"].slots
    first = next(k for k, n in enumerate(slots) if n)
    planned = next(t for t, _, _ in sim.queues["q"].plan_moves)
    # the plan at `planned` s is acted on 1 s later; the report of the round that ends at
    # planned + 2 s was sent at planned + 1 s, before: the round after shows the slots
    assert (first + 1) * trace.interval_s == planned + 2 * trace.interval_s
