"""Traces as files: validation errors, the manager's recordings, ``qcluster simulate``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qcluster.cli import cli, register_commands
from qcluster.manager.simulator import TraceError, load_trace, simulate
from qcluster.manager.simulator.figures import figures
from qcluster.manager.simulator.report import COLUMNS, HEADER, table_rows
from qcluster.policy import QueuePolicy

HAND_WRITTEN = """{"duration_s": 60,
 "hosts": {"a": {"slots": 4}},
 "queues": {"mail": {"policy": {"priority": 1, "max_slots": 4}, "rate": [[0, 20]]}}}"""

RECORDING = [
    {"type": "header", "version": 1, "started_at": 1_700_000_000.0, "interval_s": 2.0,
     "queues": {"resize": QueuePolicy.model_validate({"max_slots": 8, "priority": 5})
                .model_dump()},
     "hosts": {"demo-a": {"slots": 8}}},
    {"type": "round", "t_s": 2.0, "hosts": {"demo-a": {"slots": 8, "alive": True}},
     "queues": {"resize": {"arrived": 100, "done": 80, "backlog": 20, "mean_job_s": 0.01,
                           "slots": 1}}},
    {"type": "round", "t_s": 4.0, "hosts": {"demo-a": {"slots": 8, "alive": True},
                                            "demo-b": {"slots": 4, "alive": True}},
     "queues": {"resize": {"arrived": 300, "done": 310, "backlog": 10, "mean_job_s": None,
                           "slots": 2},
                "mail": {"arrived": 7, "done": 7, "backlog": 0, "mean_job_s": 0.2,
                         "slots": 1, "something_new": 1}},
     "extra_key": "ignored"},
    {"type": "round", "t_s": 6.0, "hosts": {"demo-a": {"slots": 8, "alive": False},
                                            "demo-b": {"slots": 6, "alive": True}},
     "queues": {"resize": {"arrived": 0, "done": 10, "backlog": 0, "mean_job_s": 0.02,
                           "slots": 2}}},
]


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_hand_written_trace_runs(tmp_path: Path) -> None:
    trace = load_trace(write(tmp_path, "t.json", HAND_WRITTEN))
    result = simulate(trace, ("qcluster",))
    mail = figures(result)["policies"]["qcluster"]["queues"]["mail"]
    assert mail["jobs"] > 0 and mail["finished"] <= mail["jobs"]


@pytest.mark.parametrize(("change", "message"), [
    ({"duration_s": -1}, "duration_s: Input should be greater than 0"),
    ({"queues": {"mail": {"policy": {"max_slots": 1, "min_slots": 3}}}},
     "queue 'mail': min_slots (3) is above max_slots (1)"),
    ({"events": [{"at_s": 1, "host": "zz", "event": "die"}]}, "unknown host 'zz'"),
    ({"queues": {"mail": {"rate": [[5, 1], [1, 2]]}}}, "rate points must be sorted by time"),
    ({"hostz": {}}, "hostz: Extra inputs are not permitted"),
    # These three ran: a misspelt queue in serves left the queue unserved, a negative
    # count took jobs away, and per_round beside rate silently replaced it.
    ({"hosts": {"a": {"slots": 4, "serves": ["mial"]}}},
     "hosts.a.serves names no queue of the trace: 'mial'"),
    ({"queues": {"mail": {"per_round": [5, -3, 2]}}},
     "queues.mail.per_round.1: Input should be greater than or equal to 0"),
    ({"queues": {"mail": {"rate": [[0, 20]], "per_round": [5]}}},
     "queues.mail: per_round replaces rate: give one of them"),
])
def test_a_bad_trace_is_refused_in_one_line(tmp_path: Path, change: dict[str, object],
                                            message: str) -> None:
    data = {**json.loads(HAND_WRITTEN), **change}
    with pytest.raises(TraceError) as caught:
        load_trace(write(tmp_path, "bad.json", json.dumps(data)))
    text = str(caught.value)
    assert message in text and "\n" not in text and text.startswith(str(tmp_path))


def test_a_manager_recording_replays(tmp_path: Path) -> None:
    lines = "\n".join(json.dumps(line) for line in RECORDING) + "\n"
    trace = load_trace(write(tmp_path, "rec.jsonl", lines))
    assert trace.interval_s == 2.0 and trace.duration_s == 6.0
    resize, mail = trace.queues["resize"], trace.queues["mail"]
    assert resize.per_round == [100, 300, 0] and mail.per_round == [0, 7, 0]
    assert resize.arrivals == "even" and resize.job_time.dist == "exponential"
    assert resize.job_time.changes == [(0.0, 0.01), (4.0, 0.02)]
    assert resize.queue_policy().priority == 5
    assert mail.queue_policy() == QueuePolicy.model_validate({})
    assert trace.hosts["demo-b"].slots == 4
    events = [(e.at_s, e.host, e.event, e.slots) for e in trace.events]
    assert (0.0, "demo-b", "die", None) in events and (2.0, "demo-b", "return", None) in events
    assert (4.0, "demo-a", "die", None) in events and (4.0, "demo-b", "capacity", 6) in events
    result = simulate(trace, ("qcluster", "static"))
    for run in result.runs.values():
        assert run.queues["resize"].arrived == 400 and run.queues["mail"].arrived == 7


def test_a_broken_recording_names_its_line(tmp_path: Path) -> None:
    lines = [json.dumps(RECORDING[0]), json.dumps(RECORDING[1]), '{"type": "round", "t_s": -1}']
    with pytest.raises(TraceError, match=r"rec.jsonl:3: t_s: Input should be greater"):
        load_trace(write(tmp_path, "rec.jsonl", "\n".join(lines)))


def test_the_command_prints_json_and_writes_a_self_contained_page(tmp_path: Path) -> None:
    register_commands()
    trace = write(tmp_path, "t.json", HAND_WRITTEN)
    page = tmp_path / "report.html"
    runner = CliRunner()
    args = ["simulate", "--trace", str(trace), "--json", "--html", str(page), "--seed", "3"]
    first = runner.invoke(cli, args)
    assert first.exit_code == 0, first.output
    data = json.loads(first.output)
    assert set(data["policies"]) == {"qcluster", "hpa", "static"} and data["seed"] == 3
    assert json.loads(runner.invoke(cli, args).output) == data  # deterministic
    html = page.read_text()
    assert "<svg" in html and "polyline" in html and "mail" in html
    assert "http://" not in html and "https://" not in html and "<script src" not in html
    table = runner.invoke(cli, ["simulate", "--trace", str(trace), "--policy", "hpa"])
    assert table.exit_code == 0 and "hpa" in table.output and "p99" in table.output


def test_the_command_refuses_a_bad_trace_in_one_line(tmp_path: Path) -> None:
    register_commands()
    bad = write(tmp_path, "bad.json", '{"duration_s": 10}')
    result = CliRunner().invoke(cli, ["simulate", "--trace", str(bad)])
    assert result.exit_code == 2
    assert "hosts: Field required" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(("name", "data", "said"), [
    ("latin1.json", b'{"duration_s": 10, "hosts": {"caf\xe9": {"slots": 1}}}',
     "latin1.json:1: not UTF-8 text (byte 0xe9 at offset 33)"),
    ("rec.jsonl", b'{"type": "header"}\n{"type": "round", "\xff"}\n',
     "rec.jsonl:2: not UTF-8 text (byte 0xff at offset 38)"),
])
def test_a_trace_that_is_not_utf8_is_refused_in_one_line(
        tmp_path: Path, name: str, data: bytes, said: str) -> None:
    """It ended in a UnicodeDecodeError traceback (exit 1)."""
    register_commands()
    bad = tmp_path / name
    bad.write_bytes(data)
    result = CliRunner().invoke(cli, ["simulate", "--trace", str(bad)])
    assert result.exit_code == 2
    assert f"error: {tmp_path / said}" in " ".join(result.output.split())
    assert "Traceback" not in result.output


@pytest.mark.parametrize(("text", "said"), [
    ('{"duration_s": Infinity, "hosts": {"a": {"slots": 1}}, "queues": {"q": {}}}',
     "Infinity is not a number JSON has"),
    ('{"duration_s": 60, "hosts": {"a": {"slots": 1}}, "queues": {"q": {"rate": [[0, NaN]]}}}',
     "NaN is not a number JSON has"),
    ('{"duration_s": 60, "hosts": {"a": {"slots": 1}},'
     ' "queues": {"q": {"rate": [[0, -Infinity]]}}}', "-Infinity is not a number JSON has"),
])
def test_a_trace_with_nan_or_infinity_is_refused_in_one_line(
        tmp_path: Path, text: str, said: str) -> None:
    """Python's json reads NaN and Infinity: a duration of Infinity ended in an
    OverflowError traceback, a rate of NaN or Infinity simulated no job at all (exit 0)."""
    register_commands()
    bad = write(tmp_path, "bad.json", text)
    result = CliRunner().invoke(cli, ["simulate", "--trace", str(bad)])
    assert result.exit_code == 2, result.output
    assert f"error: {bad}: not JSON: {said}" in " ".join(result.output.split())
    assert "Traceback" not in result.output


@pytest.mark.parametrize("where", ["missing/report.html", "."])
def test_a_report_that_cannot_be_written_is_refused_before_the_simulation(
        tmp_path: Path, where: str) -> None:
    register_commands()
    trace = write(tmp_path, "t.json", HAND_WRITTEN)
    result = CliRunner().invoke(cli, ["simulate", "--trace", str(trace), "--html",
                                      str(tmp_path / where)])
    assert result.exit_code == 2
    assert f"error: --html {tmp_path / where}: " in result.output
    assert "Traceback" not in result.output and "p99" not in result.output  # not simulated


def test_a_simulation_tells_its_progress_round_by_round(tmp_path: Path) -> None:
    trace = load_trace(write(tmp_path, "t.json", HAND_WRITTEN))
    told: list[tuple[str, int, int]] = []
    simulate(trace, ["qcluster", "hpa"], progress=lambda *args: told.append(args))
    rounds = 30  # 60 s at the default 2 s interval
    assert told == [(name, done, rounds) for name in ("qcluster", "hpa")
                    for done in range(1, rounds + 1)]


def test_the_tables_whole_numbers_read_alike_whatever_their_size() -> None:
    data = {"policies": {"hpa": {"overall": dict.fromkeys(
        (key for key, _ in COLUMNS), 16.0) | {"wait_p99_s": 9.0, "slot_seconds": 2990.5,
                                             "slack": 0.333, "slot_moves": 1234},
        "queues": {}}}}
    row = dict(zip(HEADER, table_rows(data)[0], strict=True))
    assert (row["max wait s"], row["p99 wait s"]) == ("16", "9")
    assert (row["slot-s"], row["slack"], row["slot moves"]) == ("2,990.5", "0.333", "1,234")


def test_a_configuration_replaces_the_traces_policies_and_target(tmp_path: Path) -> None:
    register_commands()
    trace = write(tmp_path, "t.json", HAND_WRITTEN)  # mail: up to 4 slots, 20 jobs/s
    config = write(tmp_path, "qcluster.toml", "[manager]\ntarget_utilization = 0.9\n\n"
                   "[queues.mail]\nmax_slots = 1\n\n[queues.mial]\npriority = 3\n")
    args = ["simulate", "--trace", str(trace), "--policy", "qcluster", "--json"]
    as_traced = json.loads(CliRunner().invoke(cli, args).stdout)
    configured = CliRunner().invoke(cli, [*args, "--config", str(config)])
    assert configured.exit_code == 0, configured.output
    mail = json.loads(configured.stdout)["policies"]["qcluster"]["queues"]["mail"]
    assert mail["slot_seconds"] <= 60  # one slot at most, for the trace's 60 s
    assert as_traced["policies"]["qcluster"]["queues"]["mail"]["slot_seconds"] > 60
    assert f"note: {config} configures queues the trace does not have: mial" in (
        configured.stderr)


def test_a_bad_configuration_is_refused_in_one_line(tmp_path: Path) -> None:
    register_commands()
    trace = write(tmp_path, "t.json", HAND_WRITTEN)
    config = write(tmp_path, "qcluster.toml", "[queues.mail]\nmax_slot = 1\n")
    result = CliRunner().invoke(cli, ["simulate", "--trace", str(trace), "--config",
                                      str(config)])
    assert result.exit_code == 2
    assert result.output.startswith(f"error: invalid configuration in {config}: ")
    assert "max_slot" in result.output and result.output.count("\n") == 1
