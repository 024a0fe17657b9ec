"""``qcluster dead`` and ``qcluster stats`` as a newcomer reads them: every id whole, to copy
into ``--requeue``, ``--delete`` or ``qcluster job``, and a warning for a queue name the
broker never saw rather than a reassuring zero. Against a real Redis."""

from __future__ import annotations

import uuid

import pytest

from qcluster import jobs_cli
from tests.contract.test_jobs_cli import dead_letters, run


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
