"""RabbitMQ quorum queues (``queue_type = "quorum"``): what is declared, how attempts are
counted from the broker's ``x-delivery-count``, the error that says how to move a classic
queue, and slots SIGKILLed while they work a quorum queue (0 acknowledged jobs lost)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from qcluster.broker import Broker, Settlement, open_broker
from qcluster.broker.amqp_topology import (
    DELIVERY_LIMIT_MARGIN,
    QueueTypeMismatch,
    _learn,
    dead_queue_name,
    ladder_prefix,
    split_queue_type,
)
from qcluster.broker.kombu_broker import KombuBroker
from qcluster.client import Client
from qcluster.errors import BrokerError
from qcluster.job import Delivery
from tests.conftest import rabbitmqctl, start_qcluster, wait_until
from tests.contract.conftest import with_query


def quorum(url: str) -> str:
    return with_query(url, "queue_type=quorum")


def queue_types(queue: str) -> dict[str, str]:
    """name -> type of the broker's queues whose name contains ``queue``."""
    out = rabbitmqctl("list_queues", "-q", "--no-table-headers", "name", "type")
    rows = (line.split() for line in out.splitlines())
    return {row[0]: row[1] for row in rows if len(row) == 2 and queue in row[0]}


def queue_arguments(name: str) -> str:
    out = rabbitmqctl("list_queues", "-q", "--no-table-headers", "name", "arguments")
    return next((line for line in out.splitlines() if line.split()[:1] == [name]), "")


def take_one(broker: Broker, queue: str) -> Delivery:
    got: list = []
    deadline = time.monotonic() + 60
    while not got and time.monotonic() < deadline:
        got = broker.take(queue, max_jobs=1, lock_timeout_s=60, wait_s=0.5)
    assert got, "no job came"
    return got[0]


# --- the option and what is declared ---------------------------------------------------


def test_the_url_option_is_read_and_removed_and_a_bad_value_is_refused() -> None:
    assert split_queue_type("amqp://h/?heartbeat=5&queue_type=quorum") == (
        "amqp://h/?heartbeat=5", "quorum")
    assert split_queue_type("amqp://a/;amqp://b/?queue_type=classic") == (
        "amqp://a/;amqp://b/", "classic")
    assert split_queue_type("amqp://h/") == ("amqp://h/", None)
    with pytest.raises(BrokerError, match="queue_type='stream'"):
        split_queue_type("amqp://h/?queue_type=stream")


def test_an_existing_queues_arguments_are_learnt_from_rabbitmqs_refusals() -> None:
    arguments = {"x-queue-type": "quorum", "x-delivery-limit": 15}
    assert _learn(arguments, "PRECONDITION_FAILED - inequivalent arg 'x-delivery-limit' for "
                  "queue 'q' in vhost '/': received '15' but current is '5'")
    assert arguments == {"x-queue-type": "quorum", "x-delivery-limit": 5}
    assert _learn(arguments, "inequivalent arg 'x-queue-type' for queue 'q' in vhost '/': "
                  "received the value 'quorum' of type 'longstr' but current is none")
    assert arguments == {"x-delivery-limit": 5}
    assert _learn(arguments, "inequivalent arg 'x-queue-type' for queue 'q' in vhost '/': "
                  "received none but current is the value 'quorum' of type 'longstr'")
    assert arguments["x-queue-type"] == "quorum"
    assert not _learn(arguments, "PRECONDITION_FAILED - something else")


def test_a_quorum_queue_its_ladder_and_its_dead_letter_store_are_quorum_queues(
    rabbitmq_url: str, queue_name: str
) -> None:
    broker = KombuBroker(quorum(rabbitmq_url))
    try:
        broker.set_queue_options(queue_name, queue_type="quorum", max_attempts=7)
        broker.publish_many(queue_name, [("now", b"{}")])
        broker.publish_many(queue_name, [("later", b"{}")], delay_s=30)
        job = take_one(broker, queue_name)
        broker.settle(queue_name, Settlement(dead=[(job, "bad")]))
        types = queue_types(queue_name)
        assert types[queue_name] == "quorum"
        assert types.get(dead_queue_name(queue_name)) == "quorum", types
        ladder = {name: kind for name, kind in types.items()
                  if name.startswith(ladder_prefix(queue_name))}
        assert len(ladder) == 28 and set(ladder.values()) == {"quorum"}
        # The delivery limit is a backstop behind max_attempts (see delivery_limit).
        assert f"x-delivery-limit\",{7 + DELIVERY_LIMIT_MARGIN}" in queue_arguments(
            queue_name).replace(" ", "").replace("{", "").replace("}", ""), queue_arguments(
            queue_name)
        assert broker.stats(queue_name).model_dump() == {
            "ready": 0, "locked": 0, "delayed": 1, "dead": 1}
    finally:
        broker.close()


def test_a_classic_queue_asked_for_as_quorum_is_refused_with_how_to_move_it(
    rabbitmq_url: str, queue_name: str
) -> None:
    classic = open_broker(rabbitmq_url)
    classic.publish_many(queue_name, [("old", b"{}")])
    broker = open_broker(quorum(rabbitmq_url))
    try:
        with pytest.raises(QueueTypeMismatch, match=r"exists in RabbitMQ as a classic queue.*"
                           r"docs/operations.md, 'Moving a queue to quorum queues'"):
            broker.publish_many(queue_name, [("new", b"{}")])
        assert classic.stats(queue_name).ready == 1, "the classic queue was left as it was"
    finally:
        broker.close()
        classic.close()


def test_a_producer_that_does_not_know_the_type_uses_the_existing_quorum_queue(
    rabbitmq_url: str, queue_name: str
) -> None:
    creator = KombuBroker(rabbitmq_url)
    creator.set_queue_options(queue_name, queue_type="quorum", max_attempts=3)
    creator.publish_many(queue_name, [("first", b"{}")])
    producer = KombuBroker(rabbitmq_url)  # no ?queue_type=, no policy
    try:
        producer.publish_many(queue_name, [("second", b"{}")])
        assert producer.queue_type(queue_name) == "quorum"
        wait_until(lambda: producer.stats(queue_name).ready == 2, message="2 ready")
    finally:
        producer.close()
        creator.close()


# --- attempts -------------------------------------------------------------------------


def test_a_job_whose_consumer_died_is_charged_from_its_second_death_once_each(
    rabbitmq_url: str, queue_name: str
) -> None:
    url = quorum(rabbitmq_url)
    dying = open_broker(url)
    dying.publish_many(queue_name, [("j", b"{}")])
    first = take_one(dying, queue_name)
    assert (first.attempts, first.suspect) == (1, False)
    dying.close()  # its connection ends with the job unacked: RabbitMQ counts a redelivery
    dying = open_broker(url)
    second = take_one(dying, queue_name)
    # Not charged (its consumer may have died of another job), suspect: it runs alone.
    assert (second.attempts, second.suspect) == (1, True)
    dying.close()  # it died again running alone: that death is charged
    broker = open_broker(url)
    try:
        again = take_one(broker, queue_name)
        assert (again.attempts, again.suspect) == (2, True)
        # Given back unstarted (a copy: the broker's count goes into qcluster's header),
        # the next take counts it once, not twice and not forgotten.
        broker.settle(queue_name, Settlement(release=[again]))
        third = take_one(broker, queue_name)
        assert (third.attempts, third.suspect) == (2, True)
        broker.leave(queue_name)
        broker.settle(queue_name, Settlement(ack=[third]))
    finally:
        broker.close()


def take_n(broker: Broker, queue: str, count: int) -> list[Delivery]:
    got: list[Delivery] = []
    deadline = time.monotonic() + 60
    while len(got) < count and time.monotonic() < deadline:
        got += broker.take(queue, max_jobs=count - len(got), lock_timeout_s=60, wait_s=0.5)
    assert len(got) == count, f"took {len(got)} of {count}"
    return got


def test_read_ahead_given_back_after_a_redelivery_keeps_its_count_through_another_death(
    rabbitmq_url: str, queue_name: str
) -> None:
    """A quorum message redelivered into a slot's read-ahead and given back when the slot
    leaves the queue is a copy: its count goes into qcluster's header. Kept in the broker's
    header, RabbitMQ would overwrite it at the copy's next redelivery (a death forgotten)."""
    url = quorum(rabbitmq_url)
    first_death = open_broker(url)
    first_death.publish_many(queue_name, [(f"j{i}", b"{}") for i in range(3)])
    take_n(first_death, queue_name, 3)
    first_death.close()
    broker = open_broker(url)
    second_death = open_broker(url)
    try:
        (first,) = take_n(broker, queue_name, 1)
        broker.leave(queue_name)  # whatever else was delivered goes back, a copy
        broker.settle(queue_name, Settlement(ack=[first]))
        # The first death is no one's (see amqp_messages.charged): suspect, not charged.
        assert (first.attempts, first.suspect) == (1, True)
        assert [(d.attempts, d.suspect) for d in take_n(second_death, queue_name, 2)] == [
            (1, True), (1, True)]
        second_death.close()
        rest = take_n(broker, queue_name, 2)
        assert [d.attempts for d in rest] == [2, 2], "a death was forgotten or doubled"
        broker.settle(queue_name, Settlement(ack=rest))
    finally:
        broker.close()


# --- chaos: slots SIGKILLed while they work a quorum queue --------------------------------


def _kill_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def _ledger(log_dir: Path) -> dict[int, list[tuple[int, int]]]:
    """pid -> [(payload, attempts)] as each slot process wrote them."""
    runs: dict[int, list[tuple[int, int]]] = {}
    for log in log_dir.glob("done-*.log"):
        pid = int(log.stem.removeprefix("done-"))
        runs[pid] = [(int(a), int(b)) for a, b in
                     (line.split() for line in log.read_text().splitlines() if line)]
    return runs


def test_slots_sigkilled_on_a_quorum_queue_lose_no_job_and_charge_none_for_one_crash(
    rabbitmq_url: str, queue_name: str, tmp_path: Path
) -> None:
    url = quorum(rabbitmq_url)
    client = Client(url)
    count = 400
    client.enqueue_many(queue_name, list(range(count)))  # confirmed: acknowledged jobs

    def slot() -> subprocess.Popen[bytes]:
        return start_qcluster("slot", "--app", "tests.contract.quorum_app", "--queue",
                              queue_name, "--broker", url, "--log-level", "WARNING",
                              QC_TEST_QUEUE=queue_name, QC_TEST_LOG_DIR=str(tmp_path))

    victim, survivor = slot(), slot()
    procs = [victim, survivor]
    try:
        wait_until(lambda: len(_ledger(tmp_path).get(victim.pid, [])) >= 30,
                   message="the first slot ran jobs")
        _kill_group(victim, signal.SIGKILL)  # mid-batch: its taken jobs are unacked
        victim.wait(timeout=30)
        procs.append(slot())

        def done() -> set[int]:
            return {payload for runs in _ledger(tmp_path).values() for payload, _ in runs}

        wait_until(lambda: len(done()) == count, timeout_s=180, message=f"{count} jobs done")
        wait_until(lambda: client.stats(queue_name) == {
            "ready": 0, "locked": 0, "delayed": 0, "dead": 0}, message="queue empty")
    finally:
        for proc in procs:
            _kill_group(proc, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                _kill_group(proc, signal.SIGKILL)
    runs = _ledger(tmp_path)
    # 0 lost: every acknowledged job ran; none was dead-lettered.
    assert {p for r in runs.values() for p, _ in r} == set(range(count))
    # The jobs the killed slot held (its running batch, its read-ahead) came back from
    # RabbitMQ with x-delivery-count 1, and no one can tell which ran: none is charged (each
    # runs alone, suspect; a death running alone would be). A job it ran but never acked
    # ran again, with attempt 1 again.
    others = [(p, a) for pid, r in runs.items() if pid != victim.pid for p, a in r]
    attempts = Counter(a for _, a in others)
    print(f"attempts of the jobs the other slots ran: {dict(sorted(attempts.items()))}")
    assert set(attempts) == {1}, f"a job was charged for a crash it may not have caused: {attempts}"
    client.close()


def test_a_slot_declares_its_queue_as_its_policy_says(rabbitmq_url: str, queue_name: str) -> None:
    """The policy keyword (no URL option): the slot tells its broker, which declares the
    queue, its ladder and its store as quorum queues, the delivery limit from max_attempts."""
    from qcluster.app import App
    from qcluster.job import Job
    from qcluster.slot.runtime import SlotRunner

    app = App()
    ran: list[object] = []

    @app.queue(queue_name, queue_type="quorum", max_attempts=3)
    def handle(jobs: list[Job]) -> None:
        ran.extend(job.payload for job in jobs)

    runner = SlotRunner(app, queue_name, open_broker(rabbitmq_url))
    producer = Client(rabbitmq_url)  # no app: it uses the queue as it exists
    try:
        runner.step()  # declares the queue
        producer.enqueue(queue_name, "x")
        wait_until(lambda: runner.step() is not None and ran == ["x"], message="the job ran")
        assert queue_types(queue_name)[queue_name] == "quorum"
        assert f"x-delivery-limit\",{3 + DELIVERY_LIMIT_MARGIN}" in queue_arguments(
            queue_name).replace(" ", "").replace("{", "").replace("}", "")
    finally:
        runner._flush()
        runner.broker.close()
        producer.close()


def test_past_the_delivery_limit_rabbitmq_moves_the_job_to_its_dead_letter_store(
    rabbitmq_url: str, queue_name: str
) -> None:
    """The backstop, if ever reached (here by consumers that die without qcluster's check,
    max_attempts 1: limit 11): the job is not dropped but dead-lettered, with a reason."""
    url = quorum(rabbitmq_url)
    setup = KombuBroker(url)
    setup.set_queue_options(queue_name, queue_type="quorum", max_attempts=1)
    setup.publish_many(queue_name, [("first", b"{}"), ("looping", b"{}")])
    first = take_one(setup, queue_name)
    setup.settle(queue_name, Settlement(dead=[(first, "bad")]))  # the store exists now
    setup.close()
    deliveries = 0
    while deliveries < 20:
        dying = KombuBroker(url)
        got = dying.take(queue_name, max_jobs=1, lock_timeout_s=60, wait_s=3)
        dying.close()  # unacked: RabbitMQ counts a redelivery
        if not got:
            break
        deliveries += 1
    broker = KombuBroker(url)
    try:
        assert deliveries == 11, "RabbitMQ gives the job out as many times as the limit"
        wait_until(lambda: broker.stats(queue_name).dead == 2, message="2 dead letters")
        reasons = {d.id: d.reason for d in broker.dead_jobs(queue_name)}
        assert reasons == {"first": "bad",
                           "looping": "dead-lettered by RabbitMQ: delivery_limit"}
        assert broker.stats(queue_name).ready == 0
    finally:
        broker.close()


def test_queue_type_in_the_configuration_rides_in_every_rabbitmq_url(tmp_path: Path) -> None:
    from qcluster.config import load_settings
    from qcluster.errors import ConfigError

    config = tmp_path / "qcluster.toml"
    config.write_text('broker_url = "amqp://h//?heartbeat=5;amqp://g//"\nqueue_type = "quorum"\n')
    assert load_settings(config).broker_url == (
        "amqp://h//?heartbeat=5&queue_type=quorum;amqp://g//?queue_type=quorum")
    assert load_settings(config, broker_url="amqp://x//?queue_type=classic").broker_url == (
        "amqp://x//?queue_type=classic"), "a URL's own option wins"
    assert load_settings(config, broker_url="redis://h/0").broker_url == "redis://h/0"
    config.write_text('queue_type = "stream"\n')
    with pytest.raises(ConfigError, match="queue_type: Input should be 'classic' or 'quorum'"):
        load_settings(config)


def test_a_producer_given_the_app_declares_the_queue_as_its_policy_says(
    rabbitmq_url: str, queue_name: str
) -> None:
    """Producers usually start first: with its app, the producer creates the queue as a
    quorum queue (no URL option), with the delivery limit from max_attempts."""
    from qcluster.app import App
    from qcluster.job import Job

    app = App()

    @app.queue(queue_name, queue_type="quorum", max_attempts=4)
    def handle(jobs: list[Job]) -> None:
        pass

    with Client(rabbitmq_url, app=app) as producer:
        producer.enqueue(queue_name, "x")
        assert queue_types(queue_name)[queue_name] == "quorum"
        assert f"x-delivery-limit\",{4 + DELIVERY_LIMIT_MARGIN}" in queue_arguments(
            queue_name).replace(" ", "").replace("{", "").replace("}", "")
        assert producer.stats(queue_name)["ready"] == 1


def test_leaving_a_deep_quorum_queue_charges_no_job(rabbitmq_url: str, queue_name: str) -> None:
    """A slot that leaves a queue right after acking (a queue switch, SIGTERM): RabbitMQ
    had already assigned more jobs to its consumer. Cancelled before they arrived, they would
    come back later counted as a redelivery (attempts 2, suspect) though they never ran."""
    url = quorum(rabbitmq_url)
    broker = open_broker(url)
    broker.publish_many(queue_name, [(f"j{i}", b"{}") for i in range(600)])
    for _ in range(10):
        taken = broker.take(queue_name, max_jobs=10, lock_timeout_s=60, wait_s=5)
        taken = broker.settle_and_take(queue_name, Settlement(ack=taken), max_jobs=10,
                                       lock_timeout_s=60, wait_s=5, read_ahead=True)
        broker.settle(queue_name, Settlement(ack=taken))
        broker.leave(queue_name)
    broker.close()
    reader = open_broker(url)
    try:
        rest = take_n(reader, queue_name, reader.stats(queue_name).ready)
        # Charged or not, one redelivered would be suspect (see amqp_messages.charged).
        assert Counter((d.attempts, d.suspect) for d in rest) == {(1, False): 600 - 200}
        reader.settle(queue_name, Settlement(ack=rest))
    finally:
        reader.close()


def test_a_stream_queue_of_that_name_is_refused(rabbitmq_url: str, queue_name: str) -> None:
    broker = KombuBroker(rabbitmq_url)
    try:
        broker.link.inspector().queue_declare(queue_name, durable=True, auto_delete=False,
                                          arguments={"x-queue-type": "stream"})
        with pytest.raises(QueueTypeMismatch, match="as a stream queue: qcluster uses classic"):
            broker.publish_many(queue_name, [("a", b"{}")])
    finally:
        broker.close()
