"""``qcluster job``, ``dead``, ``purge`` and ``stats`` against a real Redis: what each
prints, and the exit codes of the module's docstring."""

from __future__ import annotations

import json
import time
from pathlib import Path

from typer.testing import CliRunner

from qcluster import exitcodes
from qcluster.broker import Settlement, open_broker
from qcluster.cli import cli, register_commands
from qcluster.controls import Control
from qcluster.failures import JobError
from qcluster.jobs_cli import JOB_NOT_FOUND
from tests.contract.test_job_lookup import body, take


def run(*args: str) -> tuple[int, str]:
    register_commands()
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.output


def dead_letters(url: str, queue: str, ids: list[str]) -> None:
    broker = open_broker(url)
    try:
        broker.publish_many(queue, [(i, body(queue, i, {"n": i})) for i in ids])
        taken = take(broker, queue, len(ids))
        error = JobError.bounded(type="smtplib.SMTPServerDisconnected", message="went away",
                                 traceback='  File "app.py", line 9, in send\n',
                                 host="host-a", slot="2", attempt=3, at=time.time())
        broker.settle(queue, Settlement(dead=[(d, "failed 3 times") for d in taken],
                                        errors={d.id: error for d in taken}))
    finally:
        broker.close()


def test_job_shows_a_dead_letter_with_its_traceback_and_an_unknown_id_exits_15(
        redis_url: str, queue_name: str) -> None:
    dead_letters(redis_url, queue_name, ["k1"])
    code, output = run("job", "k1", "--broker", redis_url)
    assert code == 0, output
    assert "state: dead" in output and "reason: failed 3 times" in output
    assert "smtplib.SMTPServerDisconnected: went away" in output
    assert 'File "app.py", line 9' in output
    code, output = run("job", "k1", "--broker", redis_url, "--json")
    assert json.loads(output)["last_error"]["slot"] == "2"
    code, output = run("job", "nope", "--broker", redis_url, "--queue", queue_name,
                       "--manager", "http://127.0.0.1:9")
    assert code == JOB_NOT_FOUND and "no job nope" in output


def empty_config(tmp_path: Path) -> Path:
    """A configuration naming no queue (the runner's own qcluster.toml might)."""
    path = tmp_path / "empty.toml"
    path.write_text("")
    return path


def test_job_on_rabbitmq_without_a_queue_says_to_name_one(rabbitmq_url: str,
                                                           tmp_path: Path) -> None:
    """A fresh process on RabbitMQ knows no queue (AMQP cannot list them), so nothing was
    searched: it said 'no job ID in any queue', as if the job did not exist."""
    code, output = run("job", "some-id", "--broker", rabbitmq_url,
                       "--config", str(empty_config(tmp_path)),
                       "--manager", "http://127.0.0.1:9")
    assert code == JOB_NOT_FOUND, output
    assert "no queue to look in" in output and "name it with --queue QUEUE" in output


def test_dead_lists_as_json_and_requeues_and_deletes_by_id(
        redis_url: str, queue_name: str) -> None:
    dead_letters(redis_url, queue_name, ["d1", "d2", "d3"])
    code, output = run("dead", queue_name, "--json", "--broker", redis_url)
    assert code == 0, output
    listed = json.loads(output)
    assert listed["total"] == 3 and {j["id"] for j in listed["jobs"]} == {"d1", "d2", "d3"}
    assert listed["jobs"][0]["payload"] == {"n": listed["jobs"][0]["id"]}
    assert listed["jobs"][0]["error"]["type"] == "smtplib.SMTPServerDisconnected"
    code, output = run("dead", queue_name, "--delete", "d1", "nope", "--broker", redis_url)
    assert code == 0 and "deleted 1 of 2 named" in output, output
    code, output = run("dead", queue_name, "--requeue", "d2", "--broker", redis_url)
    assert code == 0 and "requeued 1 of 1 named" in output, output
    code, output = run("dead", queue_name, "--delete", "--broker", redis_url)
    assert code == exitcodes.USAGE
    code, output = run("dead", queue_name, "--broker", redis_url)
    assert code == 0 and "1 dead letter(s)" in output and "d3" in output


def test_purge_asks_unless_yes_and_stats_shows_paused(
        redis_url: str, queue_name: str) -> None:
    broker = open_broker(redis_url)
    try:
        broker.publish_many(queue_name, [("p1", body(queue_name, "p1", 1))])
        paused = Control(kind="pause", name=queue_name, by="ops", at=time.time())
        broker.write_control(paused.key, paused.stored())
        code, output = run("stats", queue_name, "--json", "--broker", redis_url,
                           "--manager", "http://127.0.0.1:9")
        # Durability notes follow the JSON (on stderr, mixed in here).
        row = json.loads(output[:output.rindex("}") + 1])[queue_name]
        assert row["paused"] is True and row["ready"] == 1 and row["rate_in"] is None
        code, output = run("purge", queue_name, "--broker", redis_url)
        assert code == exitcodes.USAGE and "--yes" in output
        assert broker.stats(queue_name).ready == 1
        code, output = run("purge", queue_name, "--yes", "--broker", redis_url)
        assert code == 0 and "purged 1 job(s)" in output, output
    finally:
        broker.write_control(f"pause:{queue_name}", None)
        broker.close()
