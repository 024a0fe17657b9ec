"""F14, several crashing poison jobs in one take, on every backend: the embedded broker and
RabbitMQ classic and quorum queues (tests/chaos/take_app.py).

Ten jobs are ready before the master starts its one slot, so that one take holds them:
eight innocent ones and two that kill the slot (``os._exit``) on every attempt (a third
case has ``batch_size`` 1: a slot whose jobs are fast still takes and reads ahead more
than its batch, and RabbitMQ redelivers all it held). A user
relies on: no innocent job is dead-lettered or charged an attempt it never ran (the
attempts it ends with are at most the runs it had); each poison job is dead-lettered after
``max_attempts`` charged crashes, and its dead letter says ``max_attempts``. The row's line
reports the charges: ``innocent_unrun_charges`` (attempts charged beyond the runs, summed
over the innocent jobs), ``innocent_dead``, and ``poison_runs`` (each poison job's attempt
numbers, in run order).

On the embedded broker the master knows which job was running: each poison job runs
exactly ``max_attempts`` times. On RabbitMQ the server redelivers every job the dead
consumer held and no process left knows which one ran (docs/chaos.md, F14): none is
charged for that first death, each comes back suspect and runs alone, and the death of a
job running alone is charged. So the poison job that crashed the shared take runs
``max_attempts + 1`` times (attempt 1 twice); the other one was held by the same consumer,
so it comes back suspect before it ever ran and runs ``max_attempts`` times (with
``batch_size`` 1 the slot may not have held it yet, and then it too runs one more time)."""

from __future__ import annotations

import pytest

from tests.chaos import take_app
from tests.chaos.conftest import ChaosRun
from tests.chaos.ledger import Run, dead_letters
from tests.conftest import free_port, wait_until

#: Where the two poison jobs sit among the ten jobs.
POISON_AT = (2, 5)
#: Each queue kind's row name in the results.
ROWS = {"take": "F14 take", "take1": "F14 take max_attempts 1",
        "takeb1": "F14 take batch_size 1"}

def unrun_charges(runs: list[Run], charged: int) -> int:
    """Attempts charged to a job beyond the runs it had: ``charged`` is the attempt count
    it ended with (its dead letter's, else its last run's number)."""
    return max(0, charged - len(runs))


def cases(kind: str, *marks: pytest.MarkDecorator) -> list[object]:
    """``kind``'s queue on each broker; the quorum queue's row runs under ``make chaos``
    (tests/contract/test_rabbitmq_quorum.py checks crash charging on quorum queues)."""
    return [pytest.param(broker, kind, id=f"{broker}-{kind}", marks=[
                *marks, *([pytest.mark.chaos] if broker == "rabbitmq-quorum" else [])])
            for broker in ("embedded", "rabbitmq", "rabbitmq-quorum")]


def expected_poison_runs(broker: str, kind: str, max_attempts: int, first: bool) -> list[
        list[int]]:
    """The attempt numbers a poison job may run with, in order: ``first`` is the poison job
    that crashed first (in a take shared with innocent jobs)."""
    charged = list(range(1, max_attempts + 1))
    if broker == "embedded":
        return [charged]
    if first:
        return [[1, *charged]]
    # Held by the dead consumer (a take of 10 holds every job): suspect before it ran.
    return [charged] if take_app.BATCH_SIZE[kind] > 1 else [charged, [1, *charged]]


@pytest.mark.parametrize(("chaos_broker", "kind"),
                         [*cases("take"), *cases("take1", pytest.mark.chaos),
                          *cases("takeb1", pytest.mark.chaos)],
                         indirect=["chaos_broker"])
def test_f14_two_crashing_poison_jobs_in_one_take(chaos: ChaosRun, kind: str) -> None:
    queue, max_attempts = take_app.name(kind, chaos.prefix), take_app.KINDS[kind]
    ids = [chaos.producer.enqueue(queue, 1, fields={"poison": "exit"} if n in POISON_AT
                                  else None)[0] for n in range(take_app.JOBS)]
    poison = {ids[n] for n in POISON_AT}
    innocent = [job_id for job_id in ids if job_id not in poison]
    port = free_port()
    chaos.procs.start("master", "master", "--app", take_app.__name__, "--broker",
                      chaos.broker.url, "--slots", f"{queue}=1",
                      "--listen", f"127.0.0.1:{port}", "--host-name", "master")
    wait_until(lambda: poison <= chaos.dead_ids([queue]) and set(innocent)
               <= chaos.ledger().completed_ids() | chaos.dead_ids([queue]), timeout_s=120,
               message="both poison jobs dead-lettered, every innocent job finished or dead")
    chaos.wait_drained([queue], timeout_s=60)
    ledger = chaos.ledger()
    dead = dead_letters(chaos.client.broker, [queue])
    runs = {job_id: sorted(ledger.runs.get(job_id, []), key=lambda r: r.start_m)
            for job_id in ids}

    def charged(job_id: str) -> int:
        if job_id in dead:
            return dead[job_id].attempts
        return runs[job_id][-1].attempt if runs[job_id] else 0

    unrun = {job_id: unrun_charges(runs[job_id], charged(job_id)) for job_id in ids}
    result = chaos.finish(
        ROWS[kind], [queue], faults=len(poison), allowed_dead=set(dead),
        batch=take_app.BATCH_SIZE[kind],
        max_attempts=max_attempts,
        innocent_unrun_charges=sum(unrun[job_id] for job_id in innocent),
        innocent_dead=len(set(dead) - poison),
        innocent_dead_never_run=sum(1 for j in set(dead) - poison if not runs[j]),
        poison_runs=[[run.attempt for run in runs[job_id]] for job_id in sorted(poison)],
        poison_dead_attempts=[dead[job_id].attempts for job_id in sorted(poison) if job_id in dead])
    assert result.lost == 0 and result.unexpected == 0, result
    assert set(dead) == poison, f"dead-lettered {sorted(dead)}, poison {sorted(poison)}"
    assert not any(unrun[job_id] for job_id in innocent), {
        job_id: [run.attempt for run in runs[job_id]] for job_id in innocent}
    first_crash = min(poison, key=lambda job_id: runs[job_id][0].start_m)
    for job_id in poison:
        attempts = [run.attempt for run in runs[job_id]]
        assert attempts in expected_poison_runs(chaos.broker.name, kind, max_attempts,
                                                job_id == first_crash), (job_id, attempts)
        assert dead[job_id].attempts == max_attempts, dead[job_id]
    assert result.residue_total == 0, result.residue
