"""The demo's load generator delivers the rates it claims, however long its ticks last."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from qcluster.demo import RESIZE_EDGE_S, arrival_rates
from qcluster.demo.feed import Feed


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0.5, 1.5), min_size=20, max_size=200))
def test_jobs_enqueued_are_the_rate_integral_whatever_the_tick_lengths(
        ticks: list[float]) -> None:
    """A loaded machine stretches the ticks (0.5 s of sleep + the enqueue time): the jobs
    due still add up to rate x time, within one job per queue."""
    feed, t, total = Feed(lambda _: {"a": 1500.0, "b": 0.3}), 0.0, {"a": 0, "b": 0}
    for tick in ticks:
        t += tick
        for queue, n in feed.due(t).items():
            total[queue] += n
    assert abs(total["a"] - 1500.0 * t) <= 1
    assert abs(total["b"] - 0.3 * t) <= 1


def test_a_slow_demo_tick_still_sends_the_square_waves_high_rate() -> None:
    """In CI a tick took ~0.53 s: counting rate x 0.5 s per tick sent ~1,420 of the resize
    queue's 1,500 jobs/s and put its need at its plan's band edge."""
    feed, t, resize = Feed(arrival_rates), 0.0, 0
    while t + 0.53 < RESIZE_EDGE_S:
        t += 0.53
        resize += feed.due(t).get("resize", 0)
    assert abs(resize / t - 1500.0) < 1


def test_the_noop_burst_is_40_000_jobs_once_per_45_s_even_with_slow_ticks() -> None:
    feed, t, noop = Feed(arrival_rates), 0.0, 0
    while t < 44.0:
        t += 0.9
        noop += feed.due(t).get("noop", 0)
    assert abs(noop - 40_000) <= 1
