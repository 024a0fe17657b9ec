"""manager/planning/arrivals.py's ledger, as properties: the counts add up exactly, never count
a job that did not come, and a host's report phase moves a job's count by a round at most, within
the margin the count carries."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from qcluster.broker.base import QueueStats
from qcluster.manager.planning.arrivals import ArrivalLedger, unreported
from tests.unit.test_arrivals import host_report, state


@given(st.lists(st.tuples(st.integers(0, 500), st.integers(0, 500), st.floats(0, 1)),
                min_size=2, max_size=60))
def test_counts_add_up_and_never_exceed_the_jobs_that_came(
        rounds: list[tuple[int, int, float]]) -> None:
    """Per round: jobs arriving, jobs settled, and the share of the settled ones the
    reports have told so far (the rest comes in later reports: lag). Counted arrivals never
    run ahead of the true ones, trail them by no more than the jobs not reported yet, and
    once the reports caught up they add up to the true arrivals exactly."""
    ledger = ArrivalLedger()
    arrived = settled = reported = counted = 0
    in_broker = 0
    for come, go, told in rounds:
        arrived += come
        go = min(go, in_broker + come)
        settled += go
        in_broker += come - go
        reported = max(reported, min(settled, reported + round(told * (settled - reported))))
        result = ledger.count(in_broker, reported, float(settled - reported))
        if result is None:
            base = in_broker + reported  # the jobs the ledger knows of at its first round
            continue
        counted += result.jobs
        assert base + counted <= arrived
        assert base + counted >= arrived - (settled - reported)
    if len(rounds) > 1:
        result = ledger.count(in_broker, settled, 0.0)  # the reports caught up
        assert result is not None
        assert base + counted + result.jobs == arrived


@settings(max_examples=30)
@given(st.floats(0.0, 1.99), st.floats(0.0, 1.99), st.integers(100, 10_000),
       st.lists(st.floats(-0.4, 0.4), min_size=60, max_size=60))
def test_a_hosts_report_phase_moves_a_count_within_its_margin(
        phase_a: float, phase_b: float, per_report: int, jitter: list[float]) -> None:
    """Two hosts report about every 2 s on their own phase, a little late or early, each
    settling ``per_report`` jobs per report at a flat rate (as many arrive: the broker
    holds none). A round sees 0, 1 or 2 reports of a host: its count is off the true
    arrivals by at most its margin (so the planner does not take it as a change; the
    margin dates reports by when they came, so a jitter of 0.4 s each way leaves it short
    by up to 0.8 s of each host's rate), and the counts add up to the jobs reported."""
    s = state(2.0)
    events = sorted((k * 2.0 + phase + jitter[k + 30 * i], f"h{i}")
                    for i, phase in enumerate((phase_a, phase_b)) for k in range(1, 30))
    total = 0
    reported = 0
    for now in [2.0 * k for k in range(2, 30)]:
        while events and events[0][0] <= now:
            at, host = events.pop(0)
            s.receive(host_report(host, {"a": 2}, {"a": per_report}, 2.0), now=at)
            reported += per_report
        s.set_stats({"a": QueueStats()})
        s.plan_round(now)
        if "a" not in s.tracks:  # no report yet (both came late): the queue is not known
            continue
        got = s.tracks["a"].arrived
        if got is None:
            first = reported
            continue
        total += got.jobs
        if now >= 8.0:
            jittered = 2 * 0.8 * per_report / 2.0
            assert abs(got.jobs - 2 * per_report) <= got.margin + jittered + 1, (now, got)
    assert first + total == reported


def test_unreported_is_each_hosts_rate_times_its_reports_age() -> None:
    assert unreported([(10.0, 100.0), (10.5, 50.0)], 11.0) == 100.0 + 25.0
    assert unreported([(12.0, 100.0)], 11.0) == 0.0  # a clock a little ahead: nothing owed


@given(st.lists(st.tuples(st.integers(0, 500), st.integers(0, 500)), min_size=1, max_size=60))
def test_a_ledger_started_at_zero_is_the_recordings_running_total(
        rounds: list[tuple[int, int]]) -> None:
    """The recorder counts on this ledger started at 0 (the recording's first round counts
    the jobs found): each round it writes ``max(0, jobs done in the recording + jobs in
    the broker - arrivals already written)``, a shortfall carried. Per round: jobs done
    since the previous one, jobs in the broker now (any: a fall the done jobs do not
    explain yet is allowed)."""
    ledger = ArrivalLedger(ledger=0)
    done = written = 0
    for processed, in_broker in rounds:
        done += processed
        expected = max(0, done + in_broker - written)
        result = ledger.count(in_broker, done, 0.0)
        assert result is not None and result.jobs == expected
        written += expected
