"""RabbitMQ hardening (issue 15), against a real RabbitMQ: jobs handed back unstarted
are not charged an attempt, a queue switch strands nothing, dead-letter stores live
where no queue name reaches, a publish is stored or raises, raw bad messages never kill
a slot, and a dead link is noticed."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import amqp
import pytest
from kombu import Connection

from qcluster import App, Client, Job
from qcluster.broker import Settlement, open_broker
from qcluster.broker.kombu_broker import KombuBroker, dead_queue_name, queue_exchange
from qcluster.errors import BrokerError
from qcluster.job import Delivery
from qcluster.slot.runtime import SlotRunner
from tests.conftest import start_qcluster, wait_until
from tests.tcp_proxy import TcpProxy


def kombu_broker(url: str) -> KombuBroker:
    broker = open_broker(url)
    assert isinstance(broker, KombuBroker)
    return broker


@pytest.fixture
def brokers(rabbitmq_url: str) -> Iterator[list[KombuBroker]]:
    """Open brokers with ``brokers.append(...)``; all are closed after the test."""
    opened: list[KombuBroker] = []
    yield opened
    for broker in opened:
        broker.close()


def take_all(broker: KombuBroker, queue: str, count: int, timeout_s: float = 20.0,
             *, ack: bool = True) -> list[Delivery]:
    """Take (and ack) until ``count`` jobs came, or fail after ``timeout_s``."""
    got: list[Delivery] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        batch = broker.take(queue, max_jobs=count - len(got), lock_timeout_s=30, wait_s=0.5)
        if ack:
            broker.ack(queue, batch)
        got += batch
    assert len(got) == count, f"took {len(got)} of {count} jobs"
    return got


def publish_raw(url: str, queue: str, messages: list[amqp.Message]) -> None:
    """Publish as any AMQP client could, bypassing qcluster's producer."""
    with Connection(url) as conn:
        channel = conn.channel()
        for message in messages:
            channel.basic_publish(message, exchange=queue_exchange(queue).name,
                                  routing_key=queue)
        channel.close()


# --- defect 2: handed back unstarted, not charged --------------------------------


def test_released_and_left_read_ahead_jobs_come_back_with_no_attempt_charged(
    rabbitmq_url: str, queue_name: str, brokers: list[KombuBroker]
) -> None:
    slot, other = kombu_broker(rabbitmq_url), kombu_broker(rabbitmq_url)
    brokers += [slot, other]
    slot.publish_many(queue_name, [(f"j{i}", b"{}") for i in range(10)])
    first = slot.settle_and_take(queue_name, Settlement(), max_jobs=2, lock_timeout_s=30,
                                 wait_s=5, read_ahead=True)
    assert len(first) == 2
    wait_until(lambda: other.stats(queue_name).ready <= 6, timeout_s=60,
               message="the next batch read ahead")
    slot.release(queue_name, first)  # taken, never started
    slot.leave(queue_name)  # the read-ahead batch, never handed out
    back = take_all(other, queue_name, 10)
    assert sorted(d.id for d in back) == sorted(f"j{i}" for i in range(10))
    assert {d.attempts for d in back} == {1}, "a job handed back unstarted was charged"


def test_jobs_held_by_a_dead_connection_come_back_uncharged_suspect_and_one_at_a_time(
    rabbitmq_url: str, queue_name: str, brokers: list[KombuBroker]
) -> None:
    slot, other = kombu_broker(rabbitmq_url), kombu_broker(rabbitmq_url)
    brokers.append(other)
    slot.publish_many(queue_name, [(f"j{i}", b"{}") for i in range(3)])
    assert len(slot.take(queue_name, max_jobs=3, lock_timeout_s=30, wait_s=5)) == 3
    slot.close()  # as when the slot process dies holding its batch (maybe of one job)
    first = other.take(queue_name, max_jobs=3, lock_timeout_s=30, wait_s=10)
    # No one knows which of the three ran: none is charged. Handed out alone, nothing
    # else held meanwhile: if it kills this slot too, that death is its own.
    assert [(d.attempts, d.suspect) for d in first] == [(1, True)]
    assert other.stats(queue_name).locked == 1
    other.close()  # it kills this slot too: charged now
    again = kombu_broker(rabbitmq_url)
    brokers.append(again)
    back = {d.id: (d.attempts, d.suspect) for d in take_all(again, queue_name, 3)}
    assert back.pop(first[0].id) == (2, True)
    assert set(back.values()) == {(1, True)}, "a batch-mate was charged"


def test_many_jobs_held_by_a_dead_connection_come_back_one_at_a_time_without_republishing(
    rabbitmq_url: str, queue_name: str, brokers: list[KombuBroker]
) -> None:
    """A dead connection returns every job it held suspect (a slot's batch and read-ahead:
    hundreds). Each then runs alone; taking a full batch of them to hand out one and give
    back the rest republished the rest for every job (40 jobs: about 400 copies; a slot
    behind a blackholed link took over 90 s for 100 on a loaded machine). Now a take of
    one job at a time (prefetch 1) leaves the rest in the queue: each job is republished
    once, when it first comes back redelivered (marked suspect), and the first batch of
    suspect copies once more."""
    jobs = 40
    slot, other = kombu_broker(rabbitmq_url), kombu_broker(rabbitmq_url)
    brokers.append(other)
    slot.publish_many(queue_name, [(f"j{i}", b"{}") for i in range(jobs)])
    take_all(slot, queue_name, jobs, ack=False)
    slot.close()  # the connection dies holding them all
    copies: list[int] = []
    publish = other.publisher.publish

    def counted(queue: str, messages: list[Any]) -> Any:
        copies.append(len(messages))
        return publish(queue, messages)

    other.publisher.publish = counted  # type: ignore[method-assign]
    sizes: list[int] = []
    while sum(sizes) < jobs:
        batch = other.take(queue_name, max_jobs=10, lock_timeout_s=30, wait_s=10)
        assert batch, f"took {sum(sizes)} of {jobs}"
        assert {(d.attempts, d.suspect) for d in batch} == {(1, True)}
        sizes.append(len(batch))
        other.ack(queue_name, batch)
    assert set(sizes) == {1}, "a suspect job was handed out with others"
    assert sum(copies) <= jobs + 10, f"{sum(copies)} copies republished for {jobs} jobs"


# --- defect 4: queue switch, on_error="lock" ----------------------------------------


def test_taking_from_another_queue_gives_back_the_first_queues_read_ahead(
    rabbitmq_url: str, queue_name: str, brokers: list[KombuBroker]
) -> None:
    second = f"{queue_name}-b"
    slot, other = kombu_broker(rabbitmq_url), kombu_broker(rabbitmq_url)
    brokers += [slot, other]
    try:
        slot.publish_many(queue_name, [(f"a{i}", b"{}") for i in range(20)])
        done = slot.settle_and_take(queue_name, Settlement(), max_jobs=5, lock_timeout_s=30,
                                    wait_s=5, read_ahead=True)
        wait_until(lambda: other.stats(queue_name).ready <= 10, timeout_s=60,
                   message="the next batch read ahead")
        slot.ack(queue_name, done)
        # The slot was moved to another queue (and did not say it left the first).
        assert slot.take(second, max_jobs=5, lock_timeout_s=30, wait_s=0.2) == []
        back = take_all(other, queue_name, 15)
        assert {d.attempts for d in back} == {1}
    finally:
        other.delete_queue(second)


def test_on_error_lock_gives_the_job_back_after_the_lock_timeout(
    rabbitmq_url: str, queue_name: str
) -> None:
    app = App()
    attempts: list[int] = []

    @app.queue(queue_name, on_error="lock", lock_timeout=3.0, batch_timeout=1.0,
               max_attempts=5)
    def explode(jobs: list[Job]) -> None:
        attempts.extend(job.attempts for job in jobs)
        raise RuntimeError("leave it locked")

    client = Client(rabbitmq_url)
    client.enqueue(queue_name, {"n": 1})
    runner = SlotRunner(app, queue_name, open_broker(rabbitmq_url))
    deadline = time.monotonic() + 30
    while len(attempts) < 2 and time.monotonic() < deadline:
        runner.step()
    runner.broker.close()
    client.close()
    assert attempts[:2] == [1, 2], "the locked job never came back"


# --- defect 5: dead-letter stores out of the queue namespace ------------------------


def test_a_queue_named_like_a_dead_letter_store_does_not_get_the_dead_letters(
    rabbitmq_url: str, queue_name: str, brokers: list[KombuBroker]
) -> None:
    lookalike = f"{queue_name}.dead"
    broker = kombu_broker(rabbitmq_url)
    brokers.append(broker)
    try:
        broker.publish(queue_name, "doomed", b"{}")
        (delivery,) = broker.take(queue_name, max_jobs=1, lock_timeout_s=30, wait_s=5)
        broker.dead(queue_name, delivery, "no future")
        assert broker.stats(queue_name).dead == 1
        assert broker.take(lookalike, max_jobs=10, lock_timeout_s=30, wait_s=0.5) == []
        assert broker.stats(lookalike).ready == 0
        assert [(d.id, d.reason) for d in broker.dead_jobs(queue_name)] == [
            ("doomed", "no future")
        ]
    finally:
        broker.delete_queue(lookalike)


# --- defect 6: a publish is stored or raises ----------------------------------------


@pytest.mark.parametrize("what", ["queue", "queue and exchange"])
def test_a_publish_after_the_queue_was_deleted_elsewhere_is_stored(
    rabbitmq_url: str, queue_name: str, brokers: list[KombuBroker], what: str
) -> None:
    producer, other = kombu_broker(rabbitmq_url), kombu_broker(rabbitmq_url)
    brokers += [producer, other]
    producer.publish(queue_name, "first", b"{}")  # declares the queue (and remembers it)
    if what == "queue":
        with Connection(rabbitmq_url) as conn:
            conn.default_channel.queue_delete(queue_name)
    else:
        other.delete_queue(queue_name)
    producer.publish(queue_name, "second", b"{}")
    producer.publish(queue_name, "third", b"{}", delay_s=1)
    back = take_all(other, queue_name, 2)
    assert sorted(d.id for d in back) == ["second", "third"]


def test_a_dead_letter_after_its_store_was_deleted_elsewhere_is_stored(
    rabbitmq_url: str, queue_name: str, brokers: list[KombuBroker]
) -> None:
    broker = kombu_broker(rabbitmq_url)
    brokers.append(broker)
    broker.publish(queue_name, "doomed", b"{}")
    (delivery,) = broker.take(queue_name, max_jobs=1, lock_timeout_s=30, wait_s=5)
    with Connection(rabbitmq_url) as conn:
        conn.default_channel.queue_delete(dead_queue_name(queue_name))
    broker.dead(queue_name, delivery, "no future")
    assert [d.id for d in broker.dead_jobs(queue_name)] == ["doomed"]


# --- defect 7: raw bad messages ------------------------------------------------------


def test_raw_bad_messages_are_dead_lettered_as_malformed_and_the_slot_lives(
    rabbitmq_url: str, queue_name: str
) -> None:
    app = App()
    handled: list[object] = []

    @app.queue(queue_name, batch_size=10)
    def handle(jobs: list[Job]) -> None:
        handled.extend(job.payload for job in jobs)

    client = Client(rabbitmq_url)
    client.enqueue(queue_name, "before")  # declares the queue and its exchange
    body = b'{"v":1,"id":"x","queue":"%s","payload":"bad","enqueued_at":1.0}' % (
        queue_name.encode()
    )

    def message(job_id: object, raw: bytes = body, **props: object) -> amqp.Message:
        props.setdefault("content_type", "application/json")
        return amqp.Message(raw, message_id=job_id, delivery_mode=2, **props)

    bad = {
        "attempts-abc": message("attempts-abc", application_headers={"x-qc-attempts": "abc"}),
        "attempts-list": message("attempts-list",
                                 application_headers={"x-qc-attempts": [1, 2]}),
        "activate-soon": message("activate-soon",
                                 application_headers={"x-qc-activate-at": "soon"}),
        "count-many": message("count-many", application_headers={"x-delivery-count": "many"}),
        "header-not-utf8": message("header-not-utf8",
                                   application_headers={"x-qc-attempts": b"\xff\xfe"}),
        "body-not-utf8": message("body-not-utf8", b"\xff\xfe{}"),
        "encoding-lies": message("encoding-lies", b"\xff\xfe{}", content_encoding="utf-8"),
        "not-compressed": message("not-compressed", b"garbage",
                                  application_headers={"compression": "application/x-gzip"}),
        "text-plain": message("text-plain", content_type="text/plain"),
    }
    publish_raw(rabbitmq_url, queue_name, [
        *bad.values(), message(b"\xff-id-not-utf8"),
    ])
    client.enqueue(queue_name, "after")
    runner = SlotRunner(app, queue_name, open_broker(rabbitmq_url))
    deadline = time.monotonic() + 30
    while client.stats(queue_name)["dead"] < len(bad) + 1 and time.monotonic() < deadline:
        runner.step()
    runner.broker.close()
    assert sorted(map(str, handled)) == ["after", "before"]
    reasons = {d.id: d.reason for d in client.dead_jobs(queue_name)}
    client.close()
    assert set(bad) <= set(reasons) and len(reasons) == len(bad) + 1
    for job_id in set(bad) - {"text-plain"}:
        assert reasons[job_id].startswith("malformed"), (job_id, reasons[job_id])
    assert "content type" in reasons["text-plain"]


# --- defect 9: a dead link --------------------------------------------------------


def proxied_url(rabbitmq_url: str, proxy: TcpProxy, query: str) -> str:
    parts = urlsplit(rabbitmq_url)
    userinfo = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
    return urlunsplit(parts._replace(netloc=f"{userinfo}127.0.0.1:{proxy.port}", query=query))


def executed(log_dir: Path) -> Counter[int]:
    counts: Counter[int] = Counter()
    for log in log_dir.glob("executed-*.log"):
        counts.update(int(line) for line in log.read_text().split())
    return counts


def test_a_slot_process_behind_a_blackholed_link_recovers_and_loses_no_job(
    rabbitmq_url: str, queue_name: str, tmp_path: Path
) -> None:
    parts = urlsplit(rabbitmq_url)
    client = Client(rabbitmq_url)
    with TcpProxy((parts.hostname or "127.0.0.1", parts.port or 5672)) as proxy:
        url = proxied_url(rabbitmq_url, proxy, "heartbeat=2&connect_timeout=2")
        slot = start_qcluster(
            "slot", "--app", "tests.apps.slot_apps", "--queue", queue_name, "--broker", url,
            "--log-level", "WARNING", QC_TEST_QUEUE=queue_name, QC_TEST_LOG_DIR=str(tmp_path),
        )
        try:
            client.enqueue(queue_name, {"n": 0})
            wait_until(lambda: executed(tmp_path)[0] == 1, timeout_s=60,
                       message="the slot running a first job")
            proxy.blackhole()
            # RabbitMQ still sees the slot's consumer and sends it these, into the void.
            client.enqueue_many(queue_name, [{"n": n} for n in range(1, 101)])
            wait_until(lambda: client.stats(queue_name)["ready"] == 100, timeout_s=60,
                       message="RabbitMQ taking the jobs back from the dead connection")
            proxy.restore()
            wait_until(lambda: set(executed(tmp_path)) == set(range(101)), timeout_s=90,
                       message="the same slot process, reconnected, running every job")
            assert slot.poll() is None, "the slot died instead of reconnecting"
        except AssertionError as failed:
            slot.kill()
            output = slot.communicate()[0].decode(errors="replace")
            raise AssertionError(f"{failed}\n--- the slot's output\n{output[-6000:]}") from None
        finally:
            slot.kill()
            slot.wait()
    client.close()


def test_a_blackholed_link_is_noticed_and_the_jobs_it_held_come_back(
    rabbitmq_url: str, queue_name: str, brokers: list[KombuBroker]
) -> None:
    parts = urlsplit(rabbitmq_url)
    with TcpProxy((parts.hostname or "127.0.0.1", parts.port or 5672)) as proxy:
        proxied = proxied_url(rabbitmq_url, proxy, "heartbeat=2&connect_timeout=2")
        direct, slot = kombu_broker(rabbitmq_url), kombu_broker(proxied)
        brokers += [direct, slot]
        direct.publish_many(queue_name, [(f"j{i}", b"{}") for i in range(5)])
        # Held, unacked (a loaded machine streams them in over more than one take).
        take_all(slot, queue_name, 5, timeout_s=60, ack=False)
        proxy.blackhole()
        outcome: list[object] = []

        def keep_taking() -> None:
            try:
                while not outcome:
                    if slot.take(queue_name, max_jobs=5, lock_timeout_s=30, wait_s=0.5):
                        outcome.append("took jobs through a dead link")
            except BrokerError as exc:
                outcome.append(exc)

        threading.Thread(target=keep_taking, daemon=True).start()
        back = take_all(direct, queue_name, 5, timeout_s=60)
        # Any of them may have been running: none is charged, each is suspect.
        assert {(d.attempts, d.suspect) for d in back} == {(1, True)}
        direct.leave(queue_name)  # its consumer would take the next job
        try:
            wait_until(lambda: outcome, timeout_s=60, message="the slot to notice the dead link")
        finally:
            outcome.append("stop")
        assert isinstance(outcome[0], BrokerError), outcome
        assert "unreachable" in str(outcome[0])
        proxy.restore()
        direct.publish(queue_name, "later", b"{}")
        (again,) = take_all(slot, queue_name, 1)  # reconnected once the link is back
        assert again.id == "later"


def test_dead_letters_are_kept_up_to_the_store_limit_newest_first(
    rabbitmq_url: str, queue_name: str, brokers: list[KombuBroker]
) -> None:
    broker = KombuBroker(rabbitmq_url, dead_max_count=3)
    brokers.append(broker)
    broker.publish_many(queue_name, [(f"j{i}", b"{}") for i in range(5)])
    for delivery in take_all(broker, queue_name, 5, ack=False):
        broker.dead(queue_name, delivery, f"no {delivery.id}")
    assert [d.id for d in broker.dead_jobs(queue_name)] == ["j4", "j3", "j2"]
    assert broker.stats(queue_name).dead == 3
