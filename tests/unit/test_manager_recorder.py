"""``qcluster manager --record``: the lines written per planning round, read back with the
format's own pydantic model; restarts, rotation, a torn last line, keys a newer version
added, and the arrival estimate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from qcluster.broker.base import QueueStats
from qcluster.config import load_settings
from qcluster.manager.planning.recorder import (
    Recorder,
    RecordHeader,
    RecordRound,
    _drop_torn_tail,
    read_recording,
    recorder_for,
)
from qcluster.manager.simulator.trace import load_trace
from tests.unit.test_manager_state import POLICIES, make_policy, report, state

T0 = 1_700_000_000.0
NOT_NEWLINE = st.characters(exclude_characters="\n", exclude_categories=["Cs"])


def rounds_of(path: Path) -> list[RecordRound]:
    return [line for line in read_recording(path) if isinstance(line, RecordRound)]


def test_each_round_writes_what_the_manager_observed(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    s = state()
    recorder = Recorder(path, interval_s=1.0, started_at=T0)
    s.receive(report("a", {"mail": 2}, processed=30, busy=1.5), now=T0 + 0.4)
    s.set_stats({"mail": QueueStats(ready=100)})
    s.plan_round(T0 + 1.0)
    recorder.record(s, T0 + 1.0)
    late = {**POLICIES, "thumbs": make_policy(priority=3)}
    s.receive(report("a", {"mail": 2}, processed=50, busy=1.0), now=T0 + 1.4)
    s.receive(report("b", {}, capacity=4, queues=late), now=T0 + 1.5)
    s.set_stats({"mail": QueueStats(ready=80)})
    s.plan_round(T0 + 2.0)
    recorder.record(s, T0 + 2.0)
    recorder.close()

    header, first, second = read_recording(path)
    assert isinstance(header, RecordHeader) and header.started_at == T0
    assert header.interval_s == 1.0 and header.model_dump()["hosts"] == {"a": {"slots": 6}}
    assert header.queues["mail"] == POLICIES["mail"]
    assert isinstance(first, RecordRound) and isinstance(second, RecordRound)
    assert first.t_s == 1.0 and second.t_s == 2.0
    mail = first.queues["mail"]
    assert (mail.done, mail.backlog, mail.slots) == (30, 100, 2)
    assert mail.arrived == 130  # the backlog found in a recording's first round arrived in it
    assert mail.mean_job_s == pytest.approx(0.05)
    mail = second.queues["mail"]
    assert (mail.done, mail.arrived, mail.backlog) == (50, 30, 80)  # 50 done + (80 - 100)
    assert second.queues["thumbs"].mean_job_s is None  # nothing done: no job time
    assert set(second.policies) == {"thumbs"}  # first seen here, not in the header
    assert second.hosts["b"].model_dump() == {"slots": 4, "alive": True}
    raw = path.read_text().splitlines()
    assert "policies" not in json.loads(raw[1])  # written only when there is one
    assert json.loads(raw[0])["queues"]["mail"] == POLICIES["mail"].model_dump()


def test_a_restarted_manager_appends_a_new_header(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    for started in (T0, T0 + 100):
        s = state()
        s.receive(report("a", {"noop": 1}), now=started + 0.5)
        recorder = Recorder(path, interval_s=1.0, started_at=started)
        recorder.record(s, started + 1.0)
        recorder.close()
    kinds = [line.type for line in read_recording(path)]
    assert kinds == ["header", "round", "header", "round"]


def test_a_manager_restarted_after_a_crash_mid_line_starts_on_a_clean_line(
        tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    s = state()
    s.receive(report("a", {"noop": 1}), now=T0 + 0.5)
    recorder = Recorder(path, interval_s=1.0, started_at=T0)
    recorder.record(s, T0 + 1.0)
    recorder.record(s, T0 + 2.0)
    recorder.close()
    whole = path.read_text()
    path.write_text(whole[:-25])  # the second round was being written
    restarted = Recorder(path, interval_s=1.0, started_at=T0 + 50)
    restarted.record(s, T0 + 51.0)
    restarted.close()
    kinds = [line.type for line in read_recording(path)]
    assert kinds == ["header", "round", "header", "round"]


def test_a_dead_host_is_recorded_as_not_alive(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    s = state()
    recorder = Recorder(path, interval_s=1.0, started_at=T0)
    s.receive(report("a", {"noop": 1}), now=T0)
    s.receive(report("b", {"noop": 1}), now=T0)
    recorder.record(s, T0 + 1.0)
    s.receive(report("a", {"noop": 1}), now=T0 + 20)
    recorder.record(s, T0 + 20.5)
    last = rounds_of(path)[-1]
    assert last.hosts["a"].alive and not last.hosts["b"].alive


def test_a_full_file_moves_to_dot_1_and_a_new_recording_starts(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    s = state()
    recorder = Recorder(path, interval_s=1.0, started_at=T0, max_bytes=2_000)
    for t in range(1, 30):
        s.receive(report("a", {"mail": 1}, processed=10, busy=0.1), now=T0 + t - 0.5)
        s.set_stats({"mail": QueueStats(ready=5)})
        recorder.record(s, T0 + t)
    recorder.close()
    older, newer = list(read_recording(path.with_name("rec.jsonl.1"))), list(read_recording(path))
    assert older[0].type == "header" and newer[0].type == "header"
    assert path.with_name("rec.jsonl.1").stat().st_size < 2_000 + 1_000
    done = [r.queues["mail"].done for r in rounds_of(path)]
    assert done and all(n == 10 for n in done)  # no sample counted twice across the move
    assert rounds_of(path)[0].queues["mail"].arrived == 15  # self-contained: backlog arrives


def test_a_torn_last_line_is_skipped_and_a_bad_middle_line_is_not(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    s = state()
    recorder = Recorder(path, interval_s=1.0, started_at=T0)
    s.receive(report("a", {"noop": 1}), now=T0 + 0.5)
    recorder.record(s, T0 + 1.0)
    recorder.close()
    whole = path.read_text()
    path.write_text(whole + whole.splitlines()[1][:40])  # a crash in the middle of a write
    assert [line.type for line in read_recording(path)] == ["header", "round"]
    path.write_text(whole.splitlines()[0] + "\n{\"type\": \"round\"}\n" + whole)
    with pytest.raises(ValidationError):
        list(read_recording(path))


def test_record_from_qcluster_toml(tmp_path: Path) -> None:
    config = tmp_path / "qcluster.toml"
    config.write_text(f'[manager]\nrecord = "{tmp_path / "day.jsonl"}"\nrecord_max_mb = 5\n')
    recorder = recorder_for(load_settings(config).manager, started_at=T0)
    assert recorder is not None and recorder.max_bytes == 5 << 20
    recorder.close()
    assert recorder_for(load_settings(None).manager, started_at=T0) is None


def test_a_replay_plans_at_the_recorded_managers_target_utilization(tmp_path: Path) -> None:
    config = tmp_path / "qcluster.toml"
    config.write_text(f'[manager]\nrecord = "{tmp_path / "day.jsonl"}"\n'
                      "target_utilization = 0.7\n")
    recorder = recorder_for(load_settings(config).manager, started_at=T0)
    assert recorder is not None
    s = state()
    s.receive(report("a", {"mail": 2}, processed=30, busy=1.5), now=T0 + 0.4)
    s.set_stats({"mail": QueueStats(ready=100)})
    s.plan_round(T0 + 1.0)
    recorder.record(s, T0 + 1.0)
    recorder.close()
    header = next(read_recording(tmp_path / "day.jsonl"))
    assert isinstance(header, RecordHeader) and header.target_utilization == 0.7
    assert load_trace(tmp_path / "day.jsonl").target_utilization == 0.7


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 500), st.integers(0, 5_000)), min_size=1,
                max_size=15))
def test_arrivals_add_up_to_jobs_done_plus_the_backlog_left(
        tmp_path_factory: pytest.TempPathFactory, rounds: list[tuple[int, int]]) -> None:
    """Whatever the backlog does, every line validates, no estimate is negative and the
    arrivals add up to the most jobs ever accounted for (done so far + in the broker): a
    fall the jobs done do not explain yet is carried, never counted twice."""
    path = tmp_path_factory.mktemp("rec") / "rec.jsonl"
    s = state()
    recorder = Recorder(path, interval_s=1.0, started_at=T0)
    for t, (done, backlog) in enumerate(rounds, start=1):
        s.receive(report("a", {"mail": 1}, processed=done, busy=done * 0.01), now=T0 + t - 0.5)
        s.set_stats({"mail": QueueStats(ready=backlog)})
        recorder.record(s, T0 + t)
    recorder.close()
    recorded = [r.queues["mail"] for r in rounds_of(path)]
    assert [(q.done, q.backlog) for q in recorded] == rounds
    done_so_far = [sum(done for done, _ in rounds[:k + 1]) for k in range(len(rounds))]
    accounted = [d + backlog for d, (_, backlog) in zip(done_so_far, rounds, strict=True)]
    assert sum(q.arrived for q in recorded) == max(accounted)


def test_jobs_taken_before_their_done_count_arrives_are_not_counted_twice(
        tmp_path: Path) -> None:
    """A burst leaves the ready list before the masters report it done (the next report):
    it arrived once. Taken jobs still in the broker (locked) count as enqueued."""
    path = tmp_path / "rec.jsonl"
    s = state()
    recorder = Recorder(path, interval_s=1.0, started_at=T0)
    seen = [(0, QueueStats(ready=40_000)), (0, QueueStats(locked=500)),
            (40_000, QueueStats()), (0, QueueStats(ready=10, locked=20))]
    for t, (done, stats) in enumerate(seen, start=1):
        s.receive(report("a", {"noop": 1}, processed=done, busy=done * 1e-6), now=T0 + t - 0.5)
        s.set_stats({"noop": stats})
        recorder.record(s, T0 + t)
    arrived = [r.queues["noop"].arrived for r in rounds_of(path)]
    assert arrived == [40_000, 0, 0, 30]
    assert rounds_of(path)[2].queues["noop"].mean_job_s == pytest.approx(1e-6)


def test_rounds_before_any_host_reported_are_not_written(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    s = state()
    recorder = Recorder(path, interval_s=1.0, started_at=T0)
    recorder.record(s, T0 + 1.0)
    assert path.read_text() == ""
    s.receive(report("a", {"mail": 1}), now=T0 + 1.5)
    recorder.record(s, T0 + 2.0)
    header, first = read_recording(path)
    assert isinstance(header, RecordHeader) and set(header.queues) == {"mail", "noop"}
    assert isinstance(first, RecordRound) and first.t_s == 2.0 and not first.policies


@given(st.lists(st.text(NOT_NEWLINE, max_size=30), max_size=6), st.text(NOT_NEWLINE, max_size=40),
       st.integers(1, 16))
def test_only_a_torn_tail_is_cut(tmp_path_factory: pytest.TempPathFactory, lines: list[str],
                                 torn: str, chunk: int) -> None:
    path = tmp_path_factory.mktemp("tail") / "rec.jsonl"
    whole = "".join(line + "\n" for line in lines)
    path.write_bytes((whole + torn).encode())
    _drop_torn_tail(path, chunk=chunk)
    assert path.read_bytes() == whole.encode()


def test_a_reader_ignores_keys_it_does_not_know_and_the_writer_cannot_add_one(
        tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    s = state()
    s.receive(report("a", {"mail": 1}, processed=3, busy=0.3), now=T0 + 0.5)
    recorder = Recorder(path, interval_s=1.0, started_at=T0)
    recorder.record(s, T0 + 1.0)
    recorder.close()
    header, first = (json.loads(line) for line in path.read_text().splitlines())
    header["hosts"]["a"]["zone"] = "b"
    header["queues"]["mail"]["new_knob"] = 1
    first["queues"]["mail"]["p99_s"] = 0.2
    first["cause"] = "timer"
    path.write_text(f"{json.dumps(header)}\n{json.dumps(first)}\n")
    newer_header, newer_first = read_recording(path)
    assert isinstance(newer_header, RecordHeader) and isinstance(newer_first, RecordRound)
    assert newer_header.queues["mail"] == POLICIES["mail"]
    assert newer_first.t_s == 1.0 and newer_first.queues["mail"].done == 3
    with pytest.raises(ValidationError, match="cause"):
        RecordRound.model_validate(first)  # the models stay closed: parse_record_line is lenient


def test_a_round_before_the_start_a_clock_stepped_back_to_is_written_at_0(
        tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    s = state()
    s.receive(report("a", {"noop": 1}), now=T0 - 5)
    recorder = Recorder(path, interval_s=1.0, started_at=T0)
    recorder.record(s, T0 - 3.0)
    recorder.close()
    assert [r.t_s for r in rounds_of(path)] == [0.0]
