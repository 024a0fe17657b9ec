"""Sizing a queue by its wait (manager/planning/wait_sizing.py): Erlang C against known
values and its direct formula, the p99 wait of M/M/1, and the sized slots' bounds and
monotonicity, each a hypothesis property."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from qcluster.manager.planning.wait_sizing import (
    MAX_UTILIZATION,
    erlang_c,
    p99_wait_s,
    round_up,
    sized_slots,
    sized_utilization,
)

TU = 0.8

works = st.floats(0.001, 200.0)
takes = st.sampled_from([0.001, 0.02, 0.05, 0.2, 0.5, 2.0, 20.0])
waits = st.sampled_from([0.25, 1.0, 5.0, 15.0, 60.0])


def erlang_c_direct(servers: int, load: float) -> float:
    """The textbook formula, term by term (fine for small counts)."""
    top = load ** servers / math.factorial(servers) * servers / (servers - load)
    below = sum(load ** k / math.factorial(k) for k in range(servers))
    return top / (below + top)


@pytest.mark.parametrize(("servers", "load", "expected"), [
    (1, 0.5, 0.5),  # M/M/1: the chance of a wait is the utilization
    (2, 1.0, 1 / 3),
    (10, 8.0, 0.4092),  # the call-centre table: 10 agents, 8 erlangs
    (100, 95.0, 0.5065),  # exact in rationals: 0.50646
])
def test_erlang_c_matches_known_values(servers: int, load: float, expected: float) -> None:
    assert erlang_c(servers, load) == pytest.approx(expected, abs=5e-4)


@given(st.integers(1, 40), st.floats(0.01, 0.999))
def test_erlang_c_matches_the_direct_formula(servers: int, share: float) -> None:
    load = servers * share
    assert erlang_c(servers, load) == pytest.approx(erlang_c_direct(servers, load), rel=1e-9)


def test_erlang_c_at_or_above_the_servers_always_waits() -> None:
    assert erlang_c(3, 3.0) == 1.0 and erlang_c(3, 7.0) == 1.0 and erlang_c(3, 0.0) == 0.0
    assert p99_wait_s(3, 3.0, 0.1) == math.inf and p99_wait_s(3, 0.0, 0.1) == 0.0


@given(st.floats(0.02, 0.99), st.floats(0.001, 10.0))
def test_p99_wait_of_one_slot_is_m_m_1s(rho: float, take_s: float) -> None:
    """M/M/1: P(wait > x) = rho exp(-(1 - rho) x / s)."""
    expected = take_s * math.log(rho / 0.01) / (1 - rho) if rho > 0.01 else 0.0
    assert p99_wait_s(1, rho, take_s) == pytest.approx(expected, rel=1e-9)


@given(works, takes, waits)
def test_sized_slots_stay_between_95_percent_busy_and_the_target_utilization(
        work: float, take_s: float, wait_s: float) -> None:
    slots = sized_slots(work, take_s, wait_s, TU)
    assert work / MAX_UTILIZATION - 1e-9 <= slots <= work / TU + 1e-9
    whole = math.ceil(slots - 1e-9)
    assert math.ceil(work / MAX_UTILIZATION - 1e-9) <= whole <= math.ceil(work / TU - 1e-9)
    assert TU - 1e-9 <= sized_utilization(work, take_s, wait_s, TU) <= MAX_UTILIZATION + 1e-9


@given(works, takes, waits)
def test_the_sized_whole_slots_keep_the_p99_wait_unless_the_target_utilization_caps_them(
        work: float, take_s: float, wait_s: float) -> None:
    slots = sized_slots(work, take_s, wait_s, TU)
    assume(slots < work / TU - 1e-9)  # not capped
    assert p99_wait_s(math.ceil(slots - 1e-9), work, take_s) <= wait_s + 1e-9


@given(works, takes, waits)
def test_one_slot_fewer_would_not_keep_the_p99_wait_or_run_past_95_percent(
        work: float, take_s: float, wait_s: float) -> None:
    """The fewest: at the inputs the cache rounds to (3 significant digits, up)."""
    work, take_s = round_up(work), round_up(take_s)
    fewer = math.ceil(sized_slots(work, take_s, wait_s, TU) - 1e-9) - 1
    assert (fewer < work / MAX_UTILIZATION - 1e-9
            or p99_wait_s(fewer, work, take_s) > wait_s - 1e-9)


@given(works, works, takes, waits)
def test_sized_slots_never_fall_as_the_work_grows(a: float, b: float, take_s: float,
                                                   wait_s: float) -> None:
    low, high = sorted((a, b))
    assert sized_slots(low, take_s, wait_s, TU) <= sized_slots(high, take_s, wait_s, TU) + 1e-9


@given(works, takes, waits, waits)
def test_a_longer_target_never_asks_for_more_slots(work: float, take_s: float, a: float,
                                                   b: float) -> None:
    short, long = sorted((a, b))
    assert sized_slots(work, take_s, long, TU) <= sized_slots(work, take_s, short, TU) + 1e-9


@given(works, takes, takes, waits)
def test_longer_takes_never_ask_for_fewer_slots(work: float, a: float, b: float,
                                                wait_s: float) -> None:
    short, long = sorted((a, b))
    assert sized_slots(work, short, wait_s, TU) <= sized_slots(work, long, wait_s, TU) + 1e-9


@given(works, takes, waits)
def test_a_target_utilization_above_95_percent_is_never_exceeded(work: float, take_s: float,
                                                                 wait_s: float) -> None:
    assert sized_slots(work, take_s, wait_s, 0.97) == pytest.approx(work / 0.97)


def test_no_work_needs_no_slot() -> None:
    assert sized_slots(0.0, 0.05, 1.0, TU) == 0.0
    assert sized_utilization(0.0, 0.05, 1.0, TU) == MAX_UTILIZATION


@given(st.floats(1e-6, 1e6), st.floats(1e-6, 1e6))
def test_round_up_is_never_below_and_never_falls(a: float, b: float) -> None:
    low, high = sorted((a, b))
    assert round_up(low) >= low * (1 - 1e-9) and round_up(low) <= low * 1.01 + 1e-12
    assert round_up(low) <= round_up(high)
    assert round_up(round_up(low)) == pytest.approx(round_up(low), rel=1e-12)
