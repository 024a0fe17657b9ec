"""Periodic jobs' declarations and tick arithmetic (qcluster/periodic.py), and the
manager's merge of ``@app.periodic`` with ``[periodic.NAME]`` (manager/planning/periodic.py).

The tick properties are checked with hypothesis over schedules and over the times at which
managers wake: no tick is enqueued twice (also by two managers sharing the broker's
compare-and-set record), none is skipped while a manager runs, none is early, and missed
ticks follow ``catch_up``.
"""

from __future__ import annotations

from itertools import islice
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qcluster.app import App
from qcluster.config import load_settings
from qcluster.errors import ConfigError
from qcluster.manager.planning.periodic import app_for_periodic, configured_jobs
from qcluster.periodic import MISSED_AFTER_S, PeriodicSpec, due_ticks, periodic_spec

MISSED_MS = round(MISSED_AFTER_S * 1000)
CRONS = ["* * * * *", "*/5 * * * *", "*/7 * * * * *", "0 0 * * * *", "15,45 * * * * *",
         "0 9-17 * * MON-FRI", "@hourly", "30 */2 * * * *"]
#: 2020-01-01T00:00:00Z and a year later, in ms.
T0, T1 = 1_577_836_800_000, 1_609_459_200_000


def spec(**fields: object) -> PeriodicSpec:
    return periodic_spec("job", {"queue": "report", **fields}, where="test")


schedules = st.one_of(
    st.builds(lambda e: spec(every=e), st.integers(1, 7200).map(float)),
    st.builds(lambda e: spec(every=e), st.floats(1.0, 100.0).map(lambda x: round(x, 3))),
    st.sampled_from(CRONS).map(lambda c: spec(cron=c)),
)


class Record:
    """The broker's record for one job: a compare-and-set on the last tick."""

    def __init__(self, start: int) -> None:
        self.last = start
        self.enqueued: list[tuple[int, int]] = []
        """(tick, when) for each enqueue."""

    def claim(self, tick: int) -> bool:
        if tick <= self.last:
            return False
        self.last = tick
        return True

    def run_pass(self, job: PeriodicSpec, now: int) -> None:
        for tick in due_ticks(job, self.last, now):
            if self.claim(tick):
                self.enqueued.append((tick, now))


# --- tick arithmetic ------------------------------------------------------------------


@given(schedules, st.integers(T0, T1))
def test_next_and_prev_ticks_bracket_a_time(job: PeriodicSpec, at: int) -> None:
    after, before = job.next_tick(at), job.prev_tick(at)
    assert before < at < after or before < after
    assert job.prev_tick(after) <= at and job.next_tick(before) >= at
    assert list(job.ticks(before, after)) == [after] or list(job.ticks(before, after))[-1] == after


@given(st.integers(1, 3600), st.integers(T0, T1), st.integers(0, 200_000))
def test_interval_ticks_are_the_epoch_aligned_multiples(every: int, start: int,
                                                         span: int) -> None:
    job = spec(every=float(every))
    step = every * 1000
    expected = [t for t in range((start // step) * step, start + span + 1, step)
                if start < t <= start + span]
    assert list(job.ticks(start, start + span)) == expected


@given(st.sampled_from(CRONS), st.integers(T0, T1))
def test_cron_ticks_are_whole_seconds_in_order(cron: str, start: int) -> None:
    job = spec(cron=cron)
    ticks = list(islice(job.ticks(start, start + 3 * 3600 * 1000), 50))
    assert all(t % 1000 == 0 for t in ticks)
    assert ticks == sorted(set(ticks))
    assert all(start < t for t in ticks)


@given(schedules, st.integers(T0, T1), st.integers(0, 50_000_000), st.integers(1, 30))
def test_newest_ticks_are_the_last_of_the_range(job: PeriodicSpec, start: int, span: int,
                                                count: int) -> None:
    newest = job.newest_ticks(start, start + span, count)
    if job.every is not None and span // round(job.every * 1000) < 2000:
        everything = list(job.ticks(start, start + span))
        assert newest == everything[-count:]
    assert newest == sorted(set(newest))
    assert all(start < t <= start + span for t in newest)


# --- which ticks a manager enqueues ------------------------------------------------------


@settings(max_examples=60)
@given(schedules, st.integers(T0, T1),
       st.lists(st.integers(1, MISSED_MS), min_size=1, max_size=40))
def test_a_running_manager_enqueues_every_tick_once_and_never_early(
        job: PeriodicSpec, start: int, gaps: list[int]) -> None:
    """Passes no further apart than MISSED_AFTER_S: every tick of the window, once."""
    record, now = Record(start), start
    for gap in gaps:
        now += gap
        record.run_pass(job, now)
    ticks = [tick for tick, _ in record.enqueued]
    assert ticks == list(job.ticks(start, now)), "a tick skipped, twice or out of order"
    assert all(tick <= when for tick, when in record.enqueued), "a tick enqueued early"


@settings(max_examples=60)
@given(schedules, st.integers(T0, T1),
       st.lists(st.tuples(st.integers(0, 1), st.integers(1, MISSED_MS // 2)),
                min_size=1, max_size=40))
def test_two_managers_enqueue_each_tick_once(job: PeriodicSpec, start: int,
                                             passes: list[tuple[int, int]]) -> None:
    """Two managers (each reading the record before its pass, each with its own clock
    running a little behind or ahead) share one compare-and-set record."""
    record, now = Record(start), start
    skew = [0, 700]  # the second manager's clock is 0.7 s behind
    for who, gap in passes:
        now += gap
        record.run_pass(job, now - skew[who])
    ticks = [tick for tick, _ in record.enqueued]
    assert len(ticks) == len(set(ticks))
    assert ticks == list(job.ticks(start, max(when for _, when in record.enqueued)
                                   if record.enqueued else start))


@settings(max_examples=80)
@given(st.integers(1, 600), st.integers(T0, T1), st.integers(MISSED_MS + 1, 10 * MISSED_MS),
       st.sampled_from(["skip", "latest", 1, 3, 50]))
def test_missed_ticks_follow_catch_up(every: int, start: int, down: int,
                                      catch_up: str | int) -> None:
    """No manager ran for ``down`` ms: the ticks older than MISSED_AFTER_S are missed, and
    catch_up enqueues none, the newest or the newest N of them; the others, all."""
    job = spec(every=float(every), catch_up=catch_up)
    now = start + down
    due = due_ticks(job, start, now)
    edge = now - MISSED_MS
    missed = list(job.ticks(start, edge))
    on_time = list(job.ticks(edge, now))
    budget = {"skip": 0, "latest": 1}.get(catch_up, catch_up)  # type: ignore[call-overload]
    assert due == (missed[-budget:] if budget else []) + on_time
    assert all(t <= now for t in due)


# --- declarations -------------------------------------------------------------------------


@pytest.mark.parametrize(("fields", "names"), [
    ({"cron": "61 * * * *"}, "cron"),
    ({"cron": "* * *"}, "cron"),
    ({"cron": "R * * * *"}, "cron"),
    ({"every": 0.5}, "every"),
    ({"every": float("nan")}, "every"),
    ({"every": 5, "cron": "* * * * *"}, "schedule"),
    ({}, "schedule"),
    ({"every": 5, "catch_up": "all"}, "catch_up"),
    ({"every": 5, "catch_up": 0}, "catch_up"),
    ({"every": 5, "catch_up": True}, "catch_up"),
    ({"every": 5, "payload": {"x": float("inf")}}, "payload"),
    ({"every": 5, "queue": "no spaces"}, "queue"),
    ({"every": 5, "bogus": 1}, "bogus"),
    ({"every": 5, "missed_after": 0}, "missed_after"),
])
def test_a_bad_declaration_is_one_line_naming_the_job_and_the_field(
        fields: dict[str, object], names: str) -> None:
    with pytest.raises(ConfigError) as caught:
        periodic_spec("nightly", {"queue": "report", **fields}, where="[periodic.nightly]")
    message = str(caught.value)
    assert "\n" not in message
    assert "'nightly'" in message and f"{names}:" in message


def test_the_decorator_declares_and_refuses_at_import() -> None:
    app = App()

    @app.periodic("*/5 * * * *", queue="report", payload={"kind": "daily"})
    @app.queue("report")
    def report(jobs: list[object]) -> None: ...

    app.periodic(every=30, queue="report", name="heartbeat")(lambda: None)
    assert report.__name__ == "report"  # returned as it was
    assert app.periodic_jobs["report"].cron == "*/5 * * * *"
    assert app.periodic_jobs["report"].payload == {"kind": "daily"}
    assert app.periodic_jobs["heartbeat"].every == 30
    assert app.with_overrides({}).periodic_jobs == app.periodic_jobs
    with pytest.raises(ConfigError, match="'report' is declared twice"):
        app.periodic(every=5, queue="report")(report)
    with pytest.raises(ConfigError, match=r"'bad'.*cron:"):
        app.periodic("not cron", queue="report", name="bad")(report)


def test_the_file_adds_jobs_and_replaces_the_apps_keys(tmp_path: Path) -> None:
    config = tmp_path / "qcluster.toml"
    config.write_text(
        '[periodic.report]\ncron = "0 * * * *"\ncatch_up = "latest"\n\n'
        '[periodic.cleanup]\nqueue = "maintenance"\nevery = 300\npayload = {days = 7}\n'
    )
    app = App()
    app.periodic(every=60, queue="report", payload={"kind": "hourly"}, name="report")(
        lambda: None)
    jobs = configured_jobs(load_settings(config), app)
    assert jobs["report"].cron == "0 * * * *" and jobs["report"].every is None
    assert jobs["report"].payload == {"kind": "hourly"} and jobs["report"].catch_up == "latest"
    assert jobs["cleanup"].every == 300 and jobs["cleanup"].payload == {"days": 7}


def test_a_bad_file_entry_is_refused_at_the_managers_start(tmp_path: Path) -> None:
    config = tmp_path / "qcluster.toml"
    config.write_text('[periodic.nightly]\nqueue = "report"\ncron = "0 25 * * *"\n')
    settings = load_settings(config)  # the other roles do not read [periodic]
    with pytest.raises(ConfigError, match=r"^periodic job 'nightly' \(\[periodic.nightly\]\): "
                                          r"cron: '0 25 \* \* \*' is not a valid cron"):
        configured_jobs(settings, None)


def test_an_incomplete_file_entry_is_refused_at_the_managers_start(tmp_path: Path) -> None:
    config = tmp_path / "qcluster.toml"
    config.write_text('[periodic.nightly]\ncron = "0 2 * * *"\n')  # no queue, no app job
    with pytest.raises(ConfigError, match=r"'nightly' \(\[periodic.nightly\]\): queue:"):
        configured_jobs(load_settings(config), None)


@pytest.mark.parametrize("source, says", [
    ("def broken(:\n", "broken_app_mod_0.py:1: "),
    ("raise RuntimeError('no database')\n", "RuntimeError: no database"),
])
def test_a_manager_whose_app_fails_to_import_goes_on_without_its_periodic_jobs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        source: str, says: str) -> None:
    """A manager's app (for its @app.periodic jobs) with a syntax error or raising at import
    ended the manager with a traceback, although a manager runs without the app's code
    (logged, the configured and reported jobs still run)."""
    name = f"broken_app_mod_{0 if 'def' in source else 1}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    settings = load_settings(None).model_copy(update={"app": name})
    with caplog.at_level("WARNING", logger="qcluster.manager.planning.periodic"):
        assert app_for_periodic(settings) is None
    assert says in caplog.text and "Traceback" not in caplog.text
