"""Replaying what ``qcluster manager --record`` writes: restarts (a second header), a torn
last line, policies carried by a round, a measured mean of 0, keys a newer version added,
every line read back as written (hypothesis), and the command end to end."""

from __future__ import annotations

import itertools
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qcluster.broker.base import QueueStats
from qcluster.manager.planning.recorder import (
    HeaderHost,
    Recorder,
    RecordHeader,
    RecordRound,
    RoundHost,
    RoundQueue,
    dump_record_line,
    read_recording,
)
from qcluster.manager.simulator import TraceError, load_trace
from qcluster.manager.simulator.trace import _rec_lines
from qcluster.manager.state import QueueObservation, RoundObservation
from qcluster.policy import QueuePolicy
from tests.unit.test_manager_state import make_policy, report, state

T0 = 1_700_000_000.0


def policy(**fields: object) -> dict[str, object]:
    return QueuePolicy.model_validate(fields).model_dump()


def header(started_at: float = T0, **queues: dict[str, object]) -> str:
    return json.dumps({"type": "header", "version": 1, "started_at": started_at,
                       "interval_s": 2.0, "queues": queues, "hosts": {"a": {"slots": 8}}})


def round_(t_s: float, arrived: dict[str, int], mean: float | None = 0.01,
           **policies: dict[str, object]) -> str:
    line: dict[str, object] = {
        "type": "round", "t_s": t_s, "hosts": {"a": {"slots": 8, "alive": True}},
        "queues": {name: {"arrived": n, "done": n, "backlog": 0, "mean_job_s": mean,
                          "slots": 1} for name, n in arrived.items()}}
    if policies:
        line["policies"] = policies
    return json.dumps(line)


def write(tmp_path: Path, lines: list[str], tail: str = "\n") -> Path:
    path = tmp_path / "rec.jsonl"
    path.write_text("\n".join(lines) + tail)
    return path


def test_a_restarted_manager_continues_the_timeline(tmp_path: Path) -> None:
    lines = [header(mail=policy()), round_(2.0, {"mail": 10}), round_(4.0, {"mail": 20}),
             # the manager stopped at T0 + 4, started again at T0 + 10: no rounds between
             header(T0 + 10.0, mail=policy(priority=3)), round_(2.0, {"mail": 30})]
    trace = load_trace(write(tmp_path, lines))
    assert trace.queues["mail"].per_round == [10, 20, 0, 0, 0, 30]
    assert trace.duration_s == 12.0
    assert trace.queues["mail"].queue_policy().priority == 3  # the latest policy


def test_a_torn_last_line_is_skipped_with_a_warning(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    lines = [header(mail=policy()), round_(2.0, {"mail": 10}), round_(4.0, {"mail": 5})]
    torn = "\n".join(lines[:2]) + "\n" + lines[2][:25]
    path = tmp_path / "rec.jsonl"
    path.write_text(torn)
    with caplog.at_level(logging.WARNING):
        trace = load_trace(path)
    assert trace.queues["mail"].per_round == [10]
    assert "rec.jsonl:3" in caplog.text and "torn" in caplog.text


def test_garbage_in_the_middle_is_refused_in_one_line(tmp_path: Path) -> None:
    lines = [header(mail=policy()), round_(2.0, {"mail": 10})[:25], round_(4.0, {"mail": 5})]
    with pytest.raises(TraceError) as caught:
        load_trace(write(tmp_path, lines))
    text = str(caught.value)
    assert "rec.jsonl:2: not JSON" in text and "\n" not in text


def test_a_round_carries_the_policy_of_a_new_queue(tmp_path: Path) -> None:
    lines = [header(mail=policy()), round_(2.0, {"mail": 10}),
             round_(4.0, {"mail": 1, "thumbs": 4}, thumbs=policy(priority=7, max_slots=3))]
    trace = load_trace(write(tmp_path, lines))
    thumbs = trace.queues["thumbs"].queue_policy()
    assert (thumbs.priority, thumbs.max_slots) == (7, 3)
    assert trace.queues["thumbs"].per_round == [0, 4]


def test_a_measured_mean_of_zero_is_accepted(tmp_path: Path) -> None:
    lines = [header(mail=policy()), round_(2.0, {"mail": 10}, mean=0.0)]
    trace = load_trace(write(tmp_path, lines))
    job_time = trace.queues["mail"].job_time
    assert 0 < job_time.mean_s <= 0.001 and job_time.changes[0][1] == job_time.mean_s


def test_the_command_replays_a_real_recording(tmp_path: Path) -> None:
    path = tmp_path / "day.jsonl"
    for start in (T0, T0 + 60.0):  # a manager, then a restarted one appending to the file
        s = state()
        recorder = Recorder(path, interval_s=1.0, started_at=start)
        late = {"thumbs": make_policy(priority=3)}
        for n in range(1, 4):
            now = start + n
            s.receive(report("a", {"mail": 2}, processed=30, busy=1.5), now=now - 0.6)
            if n == 2:
                s.receive(report("b", {}, capacity=4, queues=late), now=now - 0.5)
            s.set_stats({"mail": QueueStats(ready=100 - 10 * n), "thumbs": QueueStats(ready=n)})
            s.plan_round(now)
            recorder.record(s, now)
        recorder.close()
    with path.open("a") as file:
        file.write('{"type": "round", "t_s": 4.0, "hosts": {"a"')  # a crash mid-write
    result = subprocess.run(
        [str(Path(sys.executable).parent / "qcluster"), "simulate", "--trace", str(path), "--json"],
        capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    for run in figures["policies"].values():
        assert {"mail", "thumbs"} <= set(run["queues"])
    assert "torn" in result.stderr


def saturated_round(t_s: float, done: int, slots: int, mean: float, backlog: int) -> str:
    return json.dumps({"type": "round", "t_s": t_s, "hosts": {"a": {"slots": 8, "alive": True}},
                       "queues": {"q": {"arrived": done, "done": done, "backlog": backlog,
                                        "mean_job_s": mean, "slots": slots}}})


def test_a_recordings_per_batch_cost_is_fitted_from_its_saturated_rounds(tmp_path: Path) -> None:
    """4 slots busy for 2 s did 1,000 jobs of 2 ms: 8 ms of slot time per job, 6 ms of it
    beyond the handler, 60 ms per batch of 10. Rounds without a backlog at both ends say
    nothing of it; fewer than 3 saturated rounds fit none."""
    lines = [header(q=policy(batch_size=10)), saturated_round(2.0, 100, 4, 0.002, 0)]
    lines += [saturated_round(2.0 * k, 1000, 4, 0.002, 500) for k in range(2, 7)]
    lines.append(saturated_round(14.0, 10, 4, 0.002, 0))
    trace = load_trace(write(tmp_path, lines))
    assert trace.queues["q"].batch_cost_s == pytest.approx(0.06)
    few = load_trace(write(tmp_path, lines[:4]))  # rounds 2-3 saturated: 2 of them
    assert few.queues["q"].batch_cost_s == 0.0


def test_a_batch_cost_slows_the_simulated_slots() -> None:
    from qcluster.manager.simulator import simulate
    from qcluster.manager.simulator.trace import parse_trace

    base = {"duration_s": 120, "hosts": {"a": {"slots": 8}},
            "queues": {"q": {"policy": {"batch_size": 10, "max_slots": 2},
                             "rate": [[0, 300]], "arrivals": "even",
                             "job_time": {"dist": "fixed", "mean_s": 0.002}}}}
    costly = json.loads(json.dumps(base))
    costly["queues"]["q"]["batch_cost_s"] = 0.06
    plain = simulate(parse_trace(base), ("qcluster",)).runs["qcluster"].queues["q"]
    slowed = simulate(parse_trace(costly), ("qcluster",)).runs["qcluster"].queues["q"]
    # 300 jobs/s x 8 ms = 2.4 slot-s/s on 2 slots: a backlog grows; at 2 ms it does not.
    assert plain.backlog < 300 < slowed.backlog  # at the end
    assert slowed.busy_seconds > 2 * plain.busy_seconds


def test_keys_a_newer_version_added_are_ignored(tmp_path: Path) -> None:
    """A newer recorder's keys, in the header, a line, a host, a queue or a policy (the
    last refused before: the replay validated policies as qcluster.toml's, strictly)."""
    newer = {"type": "header", "version": 1, "started_at": T0, "interval_s": 2.0,
             "queues": {"mail": {**policy(priority=4), "new_knob": 1}},
             "hosts": {"a": {"slots": 8, "zone": "b"}}, "recorder": "9.0"}
    line = json.loads(round_(2.0, {"mail": 10}, thumbs={**policy(), "new_knob": 2}))
    line["queues"]["mail"]["p99_s"] = 0.4
    line["hosts"]["a"]["load"] = 0.5
    line["cause"] = "timer"
    trace = load_trace(write(tmp_path, [json.dumps(newer), json.dumps(line)]))
    assert trace.queues["mail"].per_round == [10]
    assert trace.queues["mail"].queue_policy().priority == 4
    assert trace.queues["thumbs"].queue_policy() == QueuePolicy.model_validate({})


FINITE = {"allow_nan": False, "allow_infinity": False}
NAMES = st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=6)
POLICIES = st.builds(
    lambda priority, batch, most, est: QueuePolicy.model_validate(
        {"priority": priority, "batch_size": batch, "max_slots": most, "est_job_seconds": est}),
    st.integers(-100, 100), st.integers(1, 2_000), st.integers(0, 1_000),
    st.floats(1e-6, 3_600, **FINITE))
HEADERS = st.builds(
    RecordHeader, started_at=st.floats(0, 4e9, **FINITE),
    interval_s=st.floats(0.01, 600, **FINITE),
    queues=st.dictionaries(NAMES, POLICIES, max_size=3),
    hosts=st.dictionaries(NAMES, st.builds(HeaderHost, slots=st.integers(0, 10_000)),
                          max_size=3))
COUNTS = st.integers(0, 10**9)
ROUNDS = st.builds(
    RecordRound, t_s=st.floats(0, 1e7, **FINITE),
    hosts=st.dictionaries(NAMES, st.builds(RoundHost, slots=st.integers(0, 10_000),
                                           alive=st.booleans()), max_size=3),
    queues=st.dictionaries(NAMES, st.builds(
        RoundQueue, arrived=COUNTS, done=COUNTS, backlog=COUNTS, slots=st.integers(0, 10_000),
        mean_job_s=st.none() | st.floats(0, 1e5, **FINITE)), max_size=3),
    policies=st.dictionaries(NAMES, POLICIES, max_size=2))


@settings(max_examples=60, deadline=None)
@given(HEADERS, st.lists(HEADERS | ROUNDS, max_size=5))
def test_the_replay_reads_back_every_line_the_recorder_writes(
        header: RecordHeader, rest: list[RecordHeader | RecordRound]) -> None:
    """Names with any character (U+2028 too: JSON leaves it unescaped), floats to the last
    bit, a round's policies left out when it has none."""
    lines = [header, *rest]
    text = "".join(dump_record_line(line) + "\n" for line in lines)
    assert _rec_lines(text, "rec") == lines


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.integers(0, 3_000), st.integers(0, 8),
                          st.integers(0, 2)), min_size=1, max_size=12))
def test_a_recorders_rounds_replay_as_written(tmp_path_factory: pytest.TempPathFactory,
                                              rounds: list[tuple[int, int, int, int]]) -> None:
    """Whatever the manager observed: the replay's arrivals per round are the ones the
    recorder wrote, the policy is the last one carried, the host's capacity follows."""
    path = tmp_path_factory.mktemp("rec") / "rec.jsonl"
    recorder = Recorder(path, interval_s=2.0, started_at=T0)
    variants = [QueuePolicy.model_validate({"priority": p}) for p in range(3)]
    for k, (done, backlog, capacity, variant) in enumerate(rounds, start=1):
        seen = QueueObservation(processed=done, busy_s=done * 0.01, backlog=backlog,
                                locked=0, running=1)
        recorder.write(RoundObservation(hosts={"a": (capacity, True)}, queues={"mail": seen},
                                        policies={"mail": variants[variant]}), T0 + 2.0 * k)
    recorder.close()
    written = [line for line in read_recording(path) if isinstance(line, RecordRound)]
    trace = load_trace(path)
    assert trace.queues["mail"].per_round == [r.queues["mail"].arrived for r in written]
    assert trace.queues["mail"].queue_policy() == variants[rounds[-1][3]]
    assert trace.duration_s == 2.0 * len(rounds) and trace.hosts["a"].slots == rounds[0][2]
    capacities = [capacity for _, _, capacity, _ in rounds]
    changes = [now for before, now in itertools.pairwise(capacities) if now != before]
    assert [e.slots for e in trace.events if e.event == "capacity"] == changes
