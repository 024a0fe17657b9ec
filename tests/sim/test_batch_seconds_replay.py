"""The replay's cost per batch comes from the slots' own batch seconds, as the manager
receives, keeps and records them per round; a recording without them is fitted as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qcluster.broker.base import QueueStats
from qcluster.manager.planning.recorder import Recorder, RecordRound, read_recording
from qcluster.manager.simulator import load_trace
from qcluster.messages import BatchCounters, QueueCounters
from tests.unit.test_manager_state import report, state

T0 = 1_700_000_000.0


def _report(done: int, batches: int, busy_s: float, batch_s: float) -> object:
    base = report("a", {"mail": 4}, capacity=8)
    counters = BatchCounters(done=done, batches=batches, busy_s=busy_s, batch_s=batch_s)
    return base.model_copy(update={"counters": {
        "mail": QueueCounters(counters=counters, alive_s=4.0)}})


def test_the_recording_carries_each_rounds_batches_and_their_seconds(tmp_path: Path) -> None:
    """Two reports in a round: their batches and batch seconds are summed into the
    round's line, beside the jobs done and their mean time."""
    s = state()
    s.receive(_report(100, 10, 1.0, 1.25), T0 + 1.0)  # type: ignore[arg-type]
    s.receive(_report(100, 10, 1.0, 1.35), T0 + 1.5)  # type: ignore[arg-type]
    s.stats["mail"] = QueueStats(ready=50)
    path = tmp_path / "rec.jsonl"
    recorder = Recorder(path, interval_s=2.0, started_at=T0)
    recorder.record(s, T0 + 2.0)
    recorder.close()
    rounds = [line for line in read_recording(path) if isinstance(line, RecordRound)]
    mail = rounds[0].queues["mail"]
    assert (mail.done, mail.batches, mail.batch_s, mail.mean_job_s) == (200, 20, 2.6, 0.01)


def _round(t_s: float, done: int, backlog: int, **measured: float) -> str:
    queue = {"arrived": done, "done": done, "backlog": backlog, "mean_job_s": 0.002,
             "slots": 4, **measured}
    return json.dumps({"type": "round", "t_s": t_s, "hosts": {"a": {"slots": 8, "alive": True}},
                       "queues": {"q": queue}})


def _recording(tmp_path: Path, measured: bool) -> Path:
    """4 slots, batches of 10 jobs of 2 ms, a backlog at every round, 1,000 jobs done a
    round of 2 s: 8 ms of slot time a job, which fits 60 ms a batch beyond the handler.
    But the slots idled between the load's ticks: their 100 batches a round took 2.5 s,
    2 s of it in the handler, so a batch costs 5 ms beyond it."""
    head = json.dumps({"type": "header", "version": 1, "started_at": T0, "interval_s": 2.0,
                       "queues": {"q": {"batch_size": 10}}, "hosts": {"a": {"slots": 8}}})
    extra = {"batches": 100, "batch_s": 2.5} if measured else {}
    lines = [head] + [_round(2.0 * k, 1000, 500, **extra) for k in range(1, 8)]
    path = tmp_path / f"rec-{measured}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_replays_cost_per_batch_is_the_measured_one(tmp_path: Path) -> None:
    assert load_trace(_recording(tmp_path, True)).queues["q"].batch_cost_s == pytest.approx(0.005)
    # without the fields (a recording older than them): fitted, with the idle time in it
    assert load_trace(_recording(tmp_path, False)).queues["q"].batch_cost_s == pytest.approx(0.06)


def test_the_measured_cost_is_a_sum_over_the_recording_not_a_median_of_rounds(
        tmp_path: Path) -> None:
    """A round of few batches weighs as little as it costs: 1 batch of 40 ms beyond its
    handler and 99 of 0 cost 0.4 ms each on average (a median of rounds would say 0 or
    40 ms)."""
    head = json.dumps({"type": "header", "version": 1, "started_at": T0, "interval_s": 2.0,
                       "queues": {"q": {"batch_size": 10}}, "hosts": {"a": {"slots": 8}}})
    lines = [head, _round(2.0, 10, 0, batches=1, batch_s=0.06),
             _round(4.0, 990, 0, batches=99, batch_s=1.98)]
    path = tmp_path / "rec.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert load_trace(path).queues["q"].batch_cost_s == pytest.approx(0.0004)
