"""Job lookup, the last error kept with a job, and dead letters by id, on every backend:
each state a backend can know is answered right; what it cannot know is ``unknown`` with a
note, never a wrong state."""

from __future__ import annotations

import time

import pytest

from qcluster.broker import Broker, DeadRetention, Settlement, open_broker
from qcluster.failures import JobError
from qcluster.job import Delivery, Envelope

RABBIT = ("amqp://", "amqps://", "pyamqp://")


def body(queue: str, job_id: str, payload: object) -> bytes:
    return Envelope(id=job_id, queue=queue, payload=payload,
                    enqueued_at=time.time()).model_dump_json().encode()


def error(job_id: str, attempt: int) -> JobError:
    return JobError.bounded(type="smtplib.SMTPServerDisconnected", message=f"gone {job_id}",
                            traceback="Traceback (most recent call last):\n  boom\n",
                            host="host-a", slot="1", attempt=attempt, at=time.time())


def take(broker: Broker, queue: str, count: int = 1) -> list[Delivery]:
    taken: list[Delivery] = []
    deadline = time.monotonic() + 20
    while len(taken) < count and time.monotonic() < deadline:
        taken += broker.take(queue, max_jobs=count - len(taken), lock_timeout_s=60, wait_s=0.5)
    assert len(taken) == count, f"{len(taken)} of {count} jobs came from {queue}"
    return taken


@pytest.fixture
def broker(broker_url: str) -> Broker:
    opened = open_broker(broker_url)
    yield opened  # type: ignore[misc]
    opened.close()


def is_rabbit(broker: Broker) -> bool:
    return broker.safe_url.startswith(RABBIT)


def test_a_dead_letter_keeps_its_last_error_and_is_found_by_id(
        broker: Broker, queue_name: str) -> None:
    broker.publish_many(queue_name, [("j1", body(queue_name, "j1", {"to": "a@b"}))])
    [first] = take(broker, queue_name)
    broker.settle(queue_name, Settlement(postpone=[(first, 0.0)],
                                         errors={"j1": error("j1", 1)}))
    [second] = take(broker, queue_name)
    assert second.attempts == 2
    broker.settle(queue_name, Settlement(dead=[(second, "failed 2 times")],
                                         errors={"j1": error("j1", 2)}))
    [dead] = broker.dead_jobs(queue_name)
    assert dead.error is not None and dead.error.attempt == 2
    assert dead.error.type == "smtplib.SMTPServerDisconnected"
    assert "boom" in dead.error.traceback
    info = broker.job("j1", queues=[queue_name])
    assert info is not None and info.state == "dead" and info.reason == "failed 2 times"
    assert info.payload == {"to": "a@b"}
    assert info.last_error is not None and info.last_error.attempt == 2


def test_a_retrying_job_shows_its_next_run_and_last_error(
        broker: Broker, queue_name: str) -> None:
    broker.publish_many(queue_name, [("r1", body(queue_name, "r1", 1))])
    [taken] = take(broker, queue_name)
    broker.settle(queue_name, Settlement(postpone=[(taken, 30.0)],
                                         errors={"r1": error("r1", 1)}))
    info = broker.job("r1", queues=[queue_name])
    assert info is not None
    if is_rabbit(broker):
        assert info.state == "unknown" and info.note
        return
    assert info.state == "retrying" and info.attempts == 1
    assert info.next_run_at is not None and info.next_run_at > time.time() + 20
    assert info.last_error is not None and info.last_error.message == "gone r1"
    page = broker.job_page(queue_name, "retrying")
    assert [job.id for job in page.jobs] == ["r1"]
    assert broker.job_page(queue_name, "delayed").jobs == []


def test_each_state_a_backend_knows_is_right_and_the_rest_unknown(
        broker: Broker, queue_name: str) -> None:
    broker.publish_many(queue_name, [("a", body(queue_name, "a", 1))])
    broker.publish_many(queue_name, [("d", body(queue_name, "d", 2))], delay_s=60)
    states = {"ready": "a", "delayed": "d"}
    for state, job_id in states.items():
        info = broker.job(job_id, queues=[queue_name])
        assert info is not None
        assert info.state == ("unknown" if is_rabbit(broker) else state), info
    [running] = take(broker, queue_name)
    info = broker.job("a", queues=[queue_name])
    assert info is not None and info.state in (("unknown",) if is_rabbit(broker) else ("running",))
    broker.settle(queue_name, Settlement(ack=[running]))
    info = broker.job("a", queues=[queue_name])
    if is_rabbit(broker):
        assert info is not None and info.state == "unknown" and info.note
    else:
        assert info is not None and info.state == "finished", info
        assert info.finished_at is not None and info.duration_s is not None
        assert info.duration_s >= 0 and info.attempts == 1


def test_no_finished_record_when_the_queue_keeps_none(
        broker: Broker, queue_name: str) -> None:
    if is_rabbit(broker):
        pytest.skip("RabbitMQ keeps no finished records")
    broker.publish_many(queue_name, [("n", body(queue_name, "n", 1))])
    [taken] = take(broker, queue_name)
    broker.settle(queue_name, Settlement(ack=[taken], retention=DeadRetention(
        keep_finished_s=0)))
    assert broker.job("n", queues=[queue_name]) is None
    assert broker.job("never-was", queues=[queue_name]) is None


def test_dead_letters_page_and_are_requeued_and_deleted_by_id(
        broker: Broker, queue_name: str) -> None:
    ids = [f"x{n}" for n in range(6)]
    broker.publish_many(queue_name, [(job_id, body(queue_name, job_id, job_id))
                                     for job_id in ids])
    taken = take(broker, queue_name, 6)
    broker.settle(queue_name, Settlement(dead=[(d, "no") for d in taken]))
    total, page = broker.dead_page(queue_name, offset=0, limit=4)
    assert total == 6 and len(page) == 4
    total, rest = broker.dead_page(queue_name, offset=4, limit=4)
    assert total == 6 and len(rest) == 2
    assert {d.id for d in page + rest} == set(ids)
    assert broker.delete_dead(queue_name, ["x0", "x1", "nope"]) == 2
    assert broker.requeue_dead(queue_name, ["x2", "nope"]) == 1
    assert {d.id for d in broker.dead_jobs(queue_name)} == {"x3", "x4", "x5"}
    [again] = take(broker, queue_name)
    assert again.id == "x2" and again.attempts == 1
    listed = broker.job_page(queue_name, "dead", limit=2)
    assert listed.total == 3 and len(listed.jobs) == 2
    assert all(job.state == "dead" for job in listed.jobs)


@pytest.mark.parametrize("backend", ["redis", "embedded"])  # RabbitMQ needs no give-back
def test_a_job_whose_slot_died_running_it_says_which_slot_and_how(
        backend: str, queue_name: str, request: pytest.FixtureRequest) -> None:
    """Its last error said 'its slot died while running it (on HOST slot , ...)': neither
    which slot nor why (a batch past its batch_timeout, a crash, a signal)."""
    from qcluster import App, Job
    from qcluster.messages import GiveBack, Progress
    from qcluster.slot.give_back import give_back

    broker = open_broker(str(request.getfixturevalue(f"{backend}_url")))
    request.addfinalizer(broker.close)
    app = App()

    @app.queue(queue_name, max_attempts=1)  # its only attempt: dead-lettered with the error
    def handle(jobs: list[Job]) -> None:
        pass

    broker.publish_many(queue_name, [("j1", body(queue_name, "j1", {}))])
    [taken] = take(broker, queue_name)
    order = GiveBack(queue=queue_name, receipt=int(taken.receipt),
                     jobs=[(taken.id, taken.attempts, taken.activate_at, Progress.RUNNING)],
                     slot="4", died="killed: its batch ran past the queue's batch_timeout")
    give_back(broker, app, order, rand=lambda: 0.5, slot_label="2")
    info = broker.job("j1", queues=[queue_name])
    assert info is not None and info.state == "dead" and info.last_error is not None
    assert (info.last_error.type, info.last_error.slot) == ("SlotDied", "4")
    assert info.last_error.message == ("its slot died while running it: killed: its batch "
                                       "ran past the queue's batch_timeout")
