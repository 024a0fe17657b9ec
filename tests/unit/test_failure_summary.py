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


def _reference(full: int, window_s: float):
    """The summariser's rule with no limit on keys: each key's window opens at its first
    failure past the last window's end; the first ``full`` of a window are logged."""
    opened: dict[str, tuple[float, int]] = {}

    def admit(key: str, now: float) -> bool:
        start, logged = opened.get(key, (float("-inf"), 0))
        if now >= start + window_s:
            opened[key] = (now, 1)
            return True
        opened[key] = (start, logged + 1)
        return logged < full

    return admit


many_keys = st.lists(
    st.tuples(st.integers(min_value=0, max_value=30),
              st.floats(min_value=0, max_value=4, allow_nan=False)),
    max_size=300,
)


@given(many_keys, st.integers(min_value=1, max_value=3), st.integers(min_value=1, max_value=12),
       st.booleans())
def test_windows_held_stay_bounded_by_the_kinds_failing_in_the_last_window(
        steps, full, max_keys, poll):
    summariser = FailureSummariser(window_s=10.0, full_per_window=full, max_keys=max_keys)
    seen: list[tuple[int, float]] = []
    for key, now in _timeline(steps):
        if poll:
            summariser.due(now)
            assert summariser.next_due > now  # every ended window closed
        summariser.admit(key, now)
        seen.append((key, now))
        recent = {k for k, t in seen if t > now - 10.0}
        # (the slot polls due() after every failed take and once a second)
        assert summariser.held <= (min(max_keys, len(recent)) if poll else max_keys)


@given(many_keys, st.integers(min_value=1, max_value=3), st.integers(min_value=1, max_value=12),
       st.booleans())
def test_a_kind_past_its_first_full_in_a_window_is_never_logged_in_full(
        steps, full, max_keys, poll):
    """Whatever kinds failed before (however long the slot ran), as long as no more kinds
    than followed fail within one window, each is summarised as if it were alone."""
    summariser = FailureSummariser(window_s=10.0, full_per_window=full, max_keys=max_keys)
    reference = _reference(full, 10.0)
    seen: list[tuple[int, float]] = []
    for key, now in _timeline(steps):
        seen.append((key, now))
        if len({k for k, t in seen if t > now - 10.0}) > max_keys:
            return  # more kinds at once than followed: the oldest window ended early
        if poll:
            summariser.due(now)
        assert summariser.admit(str(key), now) == reference(str(key), now)


def test_a_day_of_distinct_failures_leaves_no_window_behind_and_poison_is_summarised():
    """Regression: a window whose key never reached the counting stage was never closed,
    so after MAX_KEYS distinct raise sites every new kind was logged in full forever."""
    summariser = FailureSummariser()
    now = 0.0
    for site in range(2_000):  # a day: a new kind of failure every 43 s, once each
        now = site * 43.2
        summariser.admit(("q", "ValueError", "app.py", site), now)
        summariser.due(now + 1.0)  # the slot's tick, once a second or so
    assert summariser.held <= 1
    logged = 0
    for n in range(10_000):  # then a poison job: 10,000 failures in 100 s
        at = now + 60.0 + n * 0.01
        logged += summariser.admit(("q", "KeyError", "app.py", 9999), at)
        if n % 100 == 0:
            summariser.due(at)
    assert logged == 30  # 3 per 10 s window, as on a fresh summariser


def test_more_kinds_than_followed_at_once_end_the_oldest_window_early():
    summariser = FailureSummariser(window_s=10.0, full_per_window=1, max_keys=2)
    assert summariser.admit("a", 0.0) and not summariser.admit("a", 0.1)
    assert summariser.admit("b", 0.2) and summariser.admit("c", 0.3)  # "a" ends early
    assert summariser.held == 2 and summariser.next_due == float("-inf")
    [summary] = summariser.due(0.3)
    assert (summary.key, summary.count) == ("a", 1)
    assert not summariser.admit("c", 0.4)  # "c" is followed: its second failure counted
