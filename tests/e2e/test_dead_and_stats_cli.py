"""``qcluster dead`` and ``qcluster stats`` as a newcomer reads them: every id whole, to copy
into ``--requeue``, ``--delete`` or ``qcluster job``, and a warning for a queue name the
broker never saw rather than a reassuring zero; on RabbitMQ, which cannot list its queues,
the queues the manager knows. Against a real Redis and RabbitMQ."""

from __future__ import annotations

import json
import uuid

import pytest

from qcluster import jobs_cli
from qcluster.broker import open_broker
from tests.brokers import free_port
from tests.contract.test_jobs_cli import dead_letters, run
from tests.json_server import serving


@pytest.mark.parametrize("columns", [80, 120])
def test_dead_shows_each_id_whole_to_copy_into_requeue_or_job(
        redis_url: str, queue_name: str, columns: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The table cut ids to '7feba3f200…' in a terminal of 80 or 120 columns, and the
    id is what --requeue, --delete and `qcluster job` take."""
    ids = [uuid.uuid4().hex for _ in range(2)]
    dead_letters(redis_url, queue_name, ids)
    monkeypatch.setattr(jobs_cli.out, "_width", columns)
    code, output = run("dead", queue_name, "--broker", redis_url)
    assert code == 0, output
    assert all(one in output for one in ids), output
    assert max(len(line) for line in output.splitlines()) <= columns, output


def test_stats_and_dead_of_a_queue_the_broker_never_saw_say_so(
        redis_url: str, queue_name: str) -> None:
    """`qcluster dead emials` showed '0 dead letter(s)' and `stats emials` a row of zeros,
    as reassuring as they were wrong: the name was misspelt."""
    dead_letters(redis_url, queue_name, ["m1"])
    typo = queue_name[:-1]
    warning = f"warning: the broker knows no queue named {typo!r} (did you mean {queue_name}?)"
    for command in ("stats", "dead"):
        code, output = run(command, typo, "--broker", redis_url)
        assert code == 0 and warning in output, output
        code, output = run(command, queue_name, "--broker", redis_url)
        assert code == 0 and "warning" not in output, output


def test_stats_on_rabbitmq_shows_the_queues_the_manager_knows(
        rabbitmq_url: str, queue_name: str) -> None:
    """AMQP cannot list a broker's queues: `qcluster stats` printed an empty table while
    thousands of jobs waited (the docs' broker switch then read 'empty' at once)."""
    broker = open_broker(rabbitmq_url)
    try:
        broker.publish_many(queue_name, [(f"j{n}", b'{"n": 1}') for n in range(7)])
    finally:
        broker.close()
    view = json.dumps({"queues": [{"name": queue_name, "rate_in": 3.5, "rate_out": 0.0}]})
    with serving(view.encode()) as manager:
        code, output = run("stats", "--broker", rabbitmq_url, "--manager", manager, "--json")
    assert code == 0, output
    row = json.loads(output[output.index("{"):output.rindex("}") + 1])[queue_name]
    assert (row["ready"], row["rate_in"]) == (7, 3.5)
    nowhere = f"http://127.0.0.1:{free_port()}"
    code, output = run("stats", "--broker", rabbitmq_url, "--manager", nowhere)
    assert code == 0 and "note: no queue known" in output, output
