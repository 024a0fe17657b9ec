"""The failure summariser: nothing is lost between full lines and summaries, and no key
gets more than its share of full lines in a window."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from qcluster.slot.summary import FailureSummariser

events = st.lists(
    st.tuples(st.sampled_from("abc"), st.floats(min_value=0, max_value=5, allow_nan=False)),
    max_size=200,
)


def _timeline(steps: list[tuple[str, float]]) -> list[tuple[str, float]]:
    now, out = 0.0, []
    for key, step in steps:
        now += step
        out.append((key, now))
    return out


@given(events, st.integers(min_value=1, max_value=4), st.booleans())
def test_every_failure_is_logged_or_counted_exactly_once(steps, full, poll):
    summariser = FailureSummariser(window_s=10.0, full_per_window=full)
    logged: Counter[str] = Counter()
    counted: Counter[str] = Counter()
    for key, now in _timeline(steps):
        if poll:
            for summary in summariser.due(now):
                counted[str(summary.key)] += summary.count
        if summariser.admit(key, now):
            logged[key] += 1
    for summary in summariser.flush():
        counted[str(summary.key)] += summary.count
    assert logged + counted == Counter(key for key, _ in steps)


@given(events, st.integers(min_value=1, max_value=4))
def test_at_most_full_per_window_lines_per_key_in_any_window(steps, full):
    summariser = FailureSummariser(window_s=10.0, full_per_window=full)
    logged_at: dict[str, list[float]] = {}
    for key, now in _timeline(steps):
        if summariser.admit(key, now):
            logged_at.setdefault(key, []).append(now)
    for times in logged_at.values():
        for index, start in enumerate(times):
            within = [t for t in times[index:] if t < start + 10.0]
            # a window opens at a full line; one later window may open inside 10 s of it
            assert len(within) <= 2 * full


@given(events)
def test_a_summary_comes_only_after_its_window_ended_and_spans_less_than_it(steps):
    summariser = FailureSummariser(window_s=10.0, full_per_window=1)
    opened: dict[str, float] = {}
    for key, now in _timeline(steps):
        for summary in summariser.due(now):
            assert now >= opened[str(summary.key)] + 10.0
            assert 0 <= summary.seconds < 10.0 and summary.count >= 1
        if summariser.admit(key, now) and (key not in opened or now >= opened[key] + 10.0):
            opened[key] = now


def test_a_poison_queue_logs_three_lines_then_one_summary():
    summariser = FailureSummariser(window_s=10.0, full_per_window=3)
    full = [summariser.admit("boom", t * 0.01) for t in range(315)]
    assert full.count(True) == 3
    assert summariser.due(5.0) == []
    [summary] = summariser.due(10.0)
    assert (summary.key, summary.count) == ("boom", 312)
    assert summariser.due(20.0) == [] and summariser.flush() == []
