"""The ledger's arithmetic on synthetic files (no broker, no process): lost, unexpected,
dup_exec, recovered, early, latency, torn lines; and the row line's fields."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.chaos import rows
from tests.chaos.ledger import Ledger, Producer, append_lines, percentile, record


def lines(directory: Path, name: str, *events: dict[str, Any]) -> None:
    with (directory / name).open("a") as out:
        for event in events:
            out.write(json.dumps(event) + "\n")


def produced(directory: Path, ids: list[str], *, acked: bool = True, m: float = 0.0,
             delay: float = 0.0) -> None:
    for job_id in ids:
        lines(directory, "p-1.jsonl", {"e": "attempt", "id": job_id, "m": m, "t": m, "d": delay})
        if acked:
            lines(directory, "p-1.jsonl", {"e": "ack", "id": job_id, "m": m + 0.01, "t": m})


def ran(directory: Path, job_id: str, *, pid: int, start: float, end: str = "finish",
        attempt: int = 1, end_at: float | None = None) -> None:
    events = [{"e": "start", "id": job_id, "a": attempt, "pid": pid, "m": start, "t": start}]
    if end:
        at = start + 0.1 if end_at is None else end_at
        events.append({"e": end, "id": job_id, "a": attempt, "pid": pid, "m": at, "t": at})
    lines(directory, f"h-{pid}.jsonl", *events)


def test_lost_unexpected_and_duplicates(tmp_path: Path) -> None:
    produced(tmp_path, ["a", "b", "c", "d", "e"])
    produced(tmp_path, ["f"], acked=False)  # attempted, never acknowledged: not lost
    ran(tmp_path, "a", pid=10, start=1.0)
    ran(tmp_path, "b", pid=10, start=1.0)
    ran(tmp_path, "b", pid=11, start=2.0)  # ran to its end twice: 1 duplicate
    ran(tmp_path, "c", pid=10, start=1.5, end="")  # killed mid-run ...
    ran(tmp_path, "c", pid=12, start=4.5, attempt=2)  # ... recovered 3 s later
    # d never ran: lost. e is dead-lettered: not lost.
    ran(tmp_path, "zz", pid=12, start=5.0)  # never attempted: unexpected
    report = Ledger(tmp_path).report(dead_ids={"e"})
    assert (report.attempted, report.acknowledged, report.completed) == (6, 5, 4)
    assert report.lost == 1 and report.lost_ids == ["d"]
    assert report.unexpected == 1 and report.unexpected_ids == ["zz"]
    assert report.dup_exec == 2 and report.dup_ids == ["b", "c"]
    assert report.dup_finished == 1
    assert report.recovered == 1 and report.recovery_p99_s == pytest.approx(3.0)
    assert report.dead == 1 and report.early == 0 and report.torn_lines == 0


def test_deliberate_failures_are_not_duplicates(tmp_path: Path) -> None:
    produced(tmp_path, ["p", "h"])
    for attempt in (1, 2, 3):  # a poison job: three aborted attempts, then dead-lettered
        ran(tmp_path, "p", pid=20 + attempt, start=float(attempt), end="abort", attempt=attempt)
    ran(tmp_path, "h", pid=30, start=1.0)
    report = Ledger(tmp_path).report(dead_ids={"p"})
    assert report.lost == 0 and report.dup_exec == 0 and report.recovered == 0
    assert report.completed == 1 and report.dead == 1


def test_early_start_and_latency(tmp_path: Path) -> None:
    produced(tmp_path, ["late", "early"], m=100.0, delay=10.0)
    ran(tmp_path, "late", pid=1, start=110.5, end_at=111.0)
    ran(tmp_path, "early", pid=1, start=109.0, end_at=109.2)
    report = Ledger(tmp_path).report()
    assert report.early == 1 and report.early_ids == ["early"]
    # latency from the activation time (attempt + delay) to the first finish, at least 0
    assert report.p99_latency_s == pytest.approx(1.0)


def test_torn_lines_are_skipped_and_counted(tmp_path: Path) -> None:
    produced(tmp_path, ["a"])
    ran(tmp_path, "a", pid=1, start=1.0)
    with (tmp_path / "h-1.jsonl").open("a") as out:
        out.write('{"e": "start", "id": "a", "a": 2, "pi')  # a writer killed mid-line
    report = Ledger(tmp_path).report()
    assert report.torn_lines == 1 and report.lost == 0 and report.dup_exec == 0


def test_throughput_counts_first_finishes_in_a_window(tmp_path: Path) -> None:
    produced(tmp_path, [str(n) for n in range(10)])
    for n in range(10):
        ran(tmp_path, str(n), pid=1, start=float(n), end_at=float(n) + 1.0)
    ran(tmp_path, "3", pid=2, start=20.0, end_at=20.5)  # a duplicate is not more work
    ledger = Ledger(tmp_path)
    assert ledger.throughput(since_m=0.0, until_m=5.0) == pytest.approx(5 / 5.0)
    assert ledger.throughput() == pytest.approx(10 / 10.0)


def test_writers_append_whole_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class FakeClient:
        def __init__(self) -> None:
            self.calls: list[tuple[str, list[Any]]] = []

        def enqueue_many(self, queue: str, payloads: list[Any], *, delay: float) -> list[str]:
            if queue == "broken":
                raise ConnectionError("down")
            self.calls.append((queue, payloads))
            return [str(n) for n in range(len(payloads))]

    producer = Producer(FakeClient(), tmp_path, seed=7, chunk=3)
    assert producer.enqueue("q", 7, fields={"work_ms": 0}) == [f"s7-{n}" for n in range(7)]
    assert producer.enqueue("broken", 2, raise_errors=False) == []
    monkeypatch.setenv("QC_CHAOS_LEDGER", str(tmp_path))
    jobs = [SimpleNamespace(payload={"job_id": f"s7-{n}"}, id=f"x{n}", queue="q", attempts=1)
            for n in range(7)]
    record("start", jobs)
    record("finish", jobs)
    append_lines(tmp_path, "p", [])
    ledger = Ledger(tmp_path)
    report = ledger.report()
    assert (report.attempted, report.acknowledged, report.completed) == (9, 7, 7)
    assert report.errors == 2 and report.lost == 0 and report.unexpected == 0
    assert len(producer.client.calls) == 3  # chunks of 3, 3, 1


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 0.99) is None
    assert percentile([float(n) for n in range(1, 101)], 0.99) == 99.0
    assert percentile([5.0], 0.99) == 5.0


def test_row_line_has_the_issues_fields(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(rows, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(rows, "LATEST", tmp_path / "latest.jsonl")
    monkeypatch.setenv("QC_CHAOS_RESULTS", "1")
    result = rows.RowResult(row="L1", broker="embedded", seed=3, residue={"ready": 0},
                            extra={"note": 1})
    rows.emit(result)
    data = json.loads((tmp_path / "latest.jsonl").read_text())
    assert list(data)[:16] == [
        "row", "broker", "seed", "attempted", "acknowledged", "completed", "lost",
        "unexpected", "dup_exec", "dead", "faults", "recovery_p99_s", "throughput_jobs_s",
        "p99_latency_s", "residue", "wall_s"]
    assert data["extra"] == {"note": 1} and "CHAOS {" in capsys.readouterr().out
    rows.EMITTED.remove(result)
    monkeypatch.setenv("QC_CHAOS_SEED", "42")
    assert rows.new_seed(None) == 42 and rows.new_seed("5") == 5


def test_ledger_id_of_survives_malformed_bodies() -> None:
    from tests.chaos.ledger import ledger_id_of

    assert ledger_id_of('{"payload": {"job_id": "s1-2"}}') == "s1-2"
    assert ledger_id_of("[" * 100_000 + "]" * 100_000) is None  # RecursionError in json
    assert ledger_id_of("not json") is None and ledger_id_of('{"payload": 3}') is None


def test_report_renders_one_table_row_per_row_and_broker(tmp_path: Path) -> None:
    from tests.chaos import report

    source = tmp_path / "latest.jsonl"
    first = {"row": "F1", "broker": "embedded", "seed": 1, "lost": 0, "residue": {"ready": 0},
             "wall_s": 1.5, "profile": "full", "extra": {"batch": 20}}
    rerun = {**first, "seed": 2, "residue": {"ready": 1, "keys": 2}}
    other = {"row": "L1", "broker": "rabbitmq", "seed": 3, "recovery_p99_s": None,
             "run": "L1 alone"}
    source.write_text("\n".join(json.dumps(line) for line in (first, other, rerun)) + "\ntorn{")
    assert report.main([str(source)]) == 0
    table = (tmp_path / "latest.md").read_text().splitlines()
    rows = [line for line in table if line.startswith("| L1") or line.startswith("| F1")]
    assert [row.split(" | ")[0] for row in rows] == ["| L1", "| F1"]  # the rerun is last
    assert "| 2 |" in rows[1] and "residue: ready 1, keys 2" in rows[1] and "batch: 20" in rows[1]
    assert " - |" in rows[0]  # None shows as -
    assert "1. L1 alone: 1 rows" in table and "2. unnamed run: 1 rows" in table
    assert rows[0].endswith("| 1 |") and rows[1].endswith("| 2 |")  # each line's run
