"""What only the RabbitMQ backend has: failover URLs, reconnects, kombu producers' content types."""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from pathlib import Path

import pytest
from kombu import Connection, Producer

from qcluster import App, Client, Job, exitcodes
from qcluster.broker import SHORT_LIVED_GIVE_UP_S, Settlement, open_broker
from qcluster.broker.base import mask_url
from qcluster.broker.kombu_broker import KombuBroker, queue_exchange
from qcluster.errors import BrokerUnavailable
from qcluster.slot.runtime import SlotRunner
from tests.conftest import QCLUSTER, free_port, qcluster_env, rabbitmqctl, wait_until

#: What a blocked short-lived enqueue may take beyond SHORT_LIVED_GIVE_UP_S (a read under
#: way, a busy machine): far below the 30 s confirm timeout it waited before.
BLOCKED_MARGIN_S = 10.0


def test_failover_skips_an_unreachable_url(rabbitmq_url: str, queue_name: str) -> None:
    dead = f"amqp://guest:guest@127.0.0.1:{free_port()}//"
    broker = open_broker(f"{dead};{rabbitmq_url}")
    assert isinstance(broker, KombuBroker)
    try:
        broker.publish(queue_name, "one", b'{"n": 1}')
        (delivery,) = broker.take(queue_name, max_jobs=1, lock_timeout_s=5, wait_s=5)
        assert delivery.id == "one"
        broker.ack(queue_name, [delivery])
        assert broker.stats(queue_name).model_dump() == {
            "ready": 0, "locked": 0, "delayed": 0, "dead": 0
        }
    finally:
        broker.close()


def test_a_pickled_message_from_a_kombu_producer_is_dead_lettered_not_loaded(
    rabbitmq_url: str, queue_name: str, tmp_path: Path
) -> None:
    marker = tmp_path / "unpickled"

    class Exploit:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            import os

            return (os.system, (f"touch {marker}",))

    app = App()
    handled: list[object] = []

    @app.queue(queue_name, batch_size=5)
    def handle(jobs: list[Job]) -> None:
        handled.extend(job.payload for job in jobs)

    client = Client(rabbitmq_url)
    client.enqueue(queue_name, "fine")  # declares the queue and its exchange
    with Connection(rabbitmq_url) as conn:
        producer = Producer(conn.channel(), exchange=queue_exchange(queue_name))
        producer.publish(Exploit(), routing_key=queue_name, serializer="pickle")
    runner = SlotRunner(app, queue_name, open_broker(rabbitmq_url))
    deadline = time.monotonic() + 60
    while client.stats(queue_name)["dead"] < 1 and time.monotonic() < deadline:
        runner.step()
    runner.broker.close()
    assert handled == ["fine"]
    assert not marker.exists(), "a pickle was deserialized"
    (dead,) = client.dead_jobs(queue_name)
    assert "content type" in dead.reason and "python-serialize" in dead.reason
    client.close()


def test_a_dropped_connection_is_reopened_and_its_jobs_come_back(
    rabbitmq_url: str, queue_name: str
) -> None:
    broker = open_broker(rabbitmq_url)
    assert isinstance(broker, KombuBroker)
    try:
        broker.publish(queue_name, "j1", b"{}")
        (held,) = broker.take(queue_name, max_jobs=1, lock_timeout_s=5, wait_s=5)
        # The broker drops exactly this connection (as on a RabbitMQ node restart).
        port = broker.conn.connection.sock.getsockname()[1]
        listing = rabbitmqctl("-q", "list_connections", "pid", "peer_port")
        (pid,) = [line.split()[0] for line in listing.splitlines()
                  if line.split() and line.split()[-1] == str(port)]
        rabbitmqctl("-q", "close_connection", pid, "test")

        broker.ack(queue_name, [held])  # stale delivery: ignored, the job comes back
        again = broker.take(queue_name, max_jobs=1, lock_timeout_s=5, wait_s=10)
        # Its consumer is gone: back suspect, not charged (amqp_messages.charged).
        assert [(d.id, d.attempts, d.suspect) for d in again] == [("j1", 1, True)]
        broker.ack(queue_name, again)
        assert broker.stats(queue_name).model_dump() == {
            "ready": 0, "locked": 0, "delayed": 0, "dead": 0
        }
    finally:
        broker.close()


def test_only_a_fast_handler_gets_its_next_batch_ahead_and_a_dying_slot_loses_none(
    rabbitmq_url: str, queue_name: str
) -> None:
    app = App()
    client = Client(rabbitmq_url)
    handled: list[int] = []
    ready_during: list[int] = []

    @app.queue(queue_name, batch_size=40)
    def handle(jobs: list[Job]) -> None:
        handled.extend(job.payload for job in jobs)
        step = len(handled) // 40
        if step == 3:
            return  # fast: the next take reads ahead (counting would make it slow)
        if step == 4:
            wait_until(lambda: client.stats(queue_name)["ready"] <= 400 - 5 * 40,
                       timeout_s=60, message="the next batch delivered ahead")
        ready_during.append(client.stats(queue_name)["ready"])
        time.sleep(0.05)  # slow: a slow handler's slot never reads ahead

    client.enqueue_many(queue_name, list(range(400)))
    runner = SlotRunner(app, queue_name, open_broker(rabbitmq_url))
    for _ in range(4):
        assert runner.step()
    # Steps 1 and 2 lock exactly their batch; step 4 follows a fast batch. (What the
    # broker had sent before the switch to read-ahead stays locked too, once.)
    assert ready_during[:2] == [360, 320] and 160 <= ready_during[2] <= 200
    assert len(set(handled)) == 160
    runner.broker.close()  # the slot dies holding the batch it read ahead
    wait_until(lambda: client.stats(queue_name)["ready"] == 240, timeout_s=60,
               message="the read-ahead batch back in the queue")
    client.close()


def test_a_fast_consumer_gets_every_job_once_and_none_comes_back_suspect(
    rabbitmq_url: str, queue_name: str
) -> None:
    """Deliveries stream in right behind each ConsumeOk and are read many per call: none may
    be read before its consumer's callback exists (py-amqp would reject it, and it would
    come back redelivered: suspect, run alone)."""
    broker = open_broker(rabbitmq_url)
    try:
        ids = broker.publish_many(queue_name, [(f"j{n}", b"{}") for n in range(600)])
        seen: list[str] = []
        pending = Settlement()
        while len(seen) < len(ids):
            taken = broker.settle_and_take(queue_name, pending, max_jobs=100, lock_timeout_s=60,
                                           wait_s=60, read_ahead=len(seen) % 200 == 0)
            assert taken, f"only {len(seen)} of {len(ids)} jobs came"
            assert [(d.attempts, d.suspect) for d in taken] == [(1, False)] * len(taken)
            seen += [d.id for d in taken]
            pending = Settlement(ack=taken)
        broker.settle(queue_name, pending)
        assert sorted(seen) == sorted(ids)
        assert broker.stats(queue_name).model_dump() == {
            "ready": 0, "locked": 0, "delayed": 0, "dead": 0
        }
    finally:
        broker.close()


def test_a_confirmed_publish_is_not_sent_again_for_a_frame_read_behind_its_confirm(
        rabbitmq_url: str, queue_name: str) -> None:
    """A slot consumes queue B and publishes to queue A on the same link; the publish's
    confirm and then the broker's cancel of B's consumer (an operator deleted B) arrive
    in one read. The publish is confirmed: it is not reported failed and sent again."""
    a, b = queue_name + "-a", queue_name + "-b"
    broker = open_broker(rabbitmq_url)
    assert isinstance(broker, KombuBroker)
    try:
        broker.publish_many(b, [(f"b{n}", b"{}") for n in range(50)])
        assert broker.settle_and_take(b, Settlement(), max_jobs=5, lock_timeout_s=60,
                                      wait_s=5, read_ahead=True)
        broker.publish_many(a, [("first", b"{}")])  # declares A, opens the confirmed channel
        link, drain = broker.link, broker.link.drain
        calls: list[float] = []

        def late_first_read(timeout_s: float, **options: bool) -> bool:
            if not calls:  # (a descheduled slot: the confirm and the cancel arrive meanwhile)
                time.sleep(0.6)
            calls.append(timeout_s)
            return drain(timeout_s, **options)

        def delete_b() -> None:
            time.sleep(0.2)
            with Connection(rabbitmq_url) as other:
                other.channel().queue_delete(b)

        link.drain = late_first_read  # type: ignore[method-assign]
        deleter = threading.Thread(target=delete_b)
        deleter.start()
        broker.publish_many(a, [("only-once", b"{}")])
        deleter.join()
        link.drain = drain  # type: ignore[method-assign]
        assert broker.stats(a).ready == 2, "the confirmed publish was sent again"
    finally:
        broker.close()


def test_a_publish_blocked_by_a_resource_alarm_says_so(
    rabbitmq_url: str, queue_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """During a memory or disk alarm RabbitMQ blocks publishers: an enqueue waited its whole
    confirm timeout and failed with 'no publisher confirm', nothing said why. Now the block
    is logged when the broker announces it, the failure names it, and once the alarm
    clears publishing works again. (The node is this worker's own: its other tests run
    one at a time.)"""
    broker = KombuBroker(rabbitmq_url, confirm_timeout_s=3.0)
    try:
        broker.publish(queue_name, "before", b'{"n": 0}')
        _memory_alarm()
        try:
            with caplog.at_level(logging.WARNING, logger="qcluster.broker.amqp_link"), \
                    pytest.raises(BrokerUnavailable) as blocked:
                broker.publish(queue_name, "during", b'{"n": 1}')
            assert "no publisher confirm in 3 s: it blocks publishing (a resource alarm, " \
                   "memory or disk" in str(blocked.value)
            assert "blocks publishing (a resource alarm, memory or disk: see its log)" \
                   in caplog.text
        finally:
            rabbitmqctl("set_vm_memory_high_watermark", "0.4")
        wait_until(lambda: _publishes(broker, queue_name), timeout_s=60,
                   message="publishing again once the alarm cleared")
    finally:
        broker.close()


def _memory_alarm() -> None:
    """Raise the node's memory alarm, and wait until the node has it: the node sets it
    after the command returns, and a publish read before then goes through."""
    rabbitmqctl("set_vm_memory_high_watermark", "0.00001")
    wait_until(lambda: "memory" in rabbitmqctl("eval", "rabbit_alarm:get_alarms()."),
               timeout_s=60, interval_s=0.2, message="the memory alarm")


def _publishes(broker: KombuBroker, queue: str) -> bool:
    try:
        return broker.publish(queue, f"after-{time.monotonic()}", b'{"n": 2}')
    except BrokerUnavailable:
        return False


def test_a_short_lived_publisher_gives_up_on_a_blocked_broker(
    rabbitmq_url: str, queue_name: str
) -> None:
    """A Client's enqueue on a broker that blocks publishers (a memory alarm) waited the
    whole 30 s publisher-confirm timeout. Now it gives up SHORT_LIVED_GIVE_UP_S after the
    broker said it blocks, in one line naming the alarm. The job was already written to the
    socket, so it may or may not be stored: the line says so. The same connection's next
    enqueue, already known blocked, writes nothing and says that nothing was enqueued. A
    count (stats), which waited on that connection until the alarm cleared, is answered on
    a new one. Once the alarm clears, the Client publishes again. No timing is asserted:
    the bound is how long the test waits for the three calls to end."""
    client = Client(rabbitmq_url)
    outcomes: list[BaseException | None] = []
    counted: list[int] = []
    three_ended, cleared = threading.Event(), threading.Event()

    def enqueue(n: int) -> BaseException | None:
        try:
            client.enqueue(queue_name, {"n": n})
            return None
        except BrokerUnavailable as exc:
            return exc

    def one_connection() -> None:  # one thread: one connection (a Client's per thread)
        outcomes.extend([enqueue(1), enqueue(2)])
        counted.append(client.stats(queue_name)["ready"])
        three_ended.set()
        cleared.wait()
        wait_until(lambda: enqueue(3) is None, timeout_s=60,
                   message="publishing again once the alarm cleared")

    client.enqueue(queue_name, {"n": 0})  # the queue exists before the alarm
    _memory_alarm()
    thread = threading.Thread(target=one_connection, daemon=True)
    try:
        thread.start()
        assert three_ended.wait(timeout=SHORT_LIVED_GIVE_UP_S + BLOCKED_MARGIN_S), \
            f"a short-lived call waited for the blocked broker (ended: {outcomes}, {counted})"
        sent, refused = outcomes
        safe_url = mask_url(rabbitmq_url)
        assert isinstance(sent, BrokerUnavailable), sent
        assert str(sent).startswith(
            f"RabbitMQ at {safe_url} blocks publishers (its memory or disk alarm): what was "
            "sent may or may not be stored"), sent
        assert "nothing was enqueued" not in str(sent)
        assert isinstance(refused, BrokerUnavailable), refused
        assert str(refused).startswith(
            f"RabbitMQ at {safe_url} blocks publishers (its memory or disk alarm): nothing "
            "was enqueued; "), refused
        assert counted and counted[0] >= 1, counted  # the job enqueued before the alarm
    finally:
        rabbitmqctl("set_vm_memory_high_watermark", "0.4")
        cleared.set()
    thread.join(timeout=90)
    assert not thread.is_alive(), "the blocked connection never published again"
    client.close()


def test_qcluster_enqueue_on_a_blocked_broker_exits_5(
    rabbitmq_url: str, queue_name: str, tmp_path: Path
) -> None:
    """``qcluster enqueue`` during a memory alarm waited the 30 s confirm timeout, and
    then its close handshake, which the blocked broker does not read, until the alarm
    cleared. Now it gives up SHORT_LIVED_GIVE_UP_S after the block, drops the
    connection, and exits 5 naming the alarm. The bound is the subprocess's timeout."""
    Client(rabbitmq_url).enqueue(queue_name, {"n": 0})  # the queue exists before
    _memory_alarm()
    try:
        result = subprocess.run(
            [*QCLUSTER, "enqueue", "--broker", rabbitmq_url, queue_name, '{"n": 1}'],
            env=qcluster_env(COLUMNS="300"), capture_output=True, text=True, cwd=tmp_path,
            timeout=SHORT_LIVED_GIVE_UP_S + BLOCKED_MARGIN_S + 2.0)  # 2 s: Python starts
    finally:
        rabbitmqctl("set_vm_memory_high_watermark", "0.4")
    assert result.returncode == exitcodes.BROKER_CONNECT, result
    assert f"RabbitMQ at {mask_url(rabbitmq_url)} blocks publishers (its memory or disk " \
           "alarm): what was sent may or may not be stored" in result.stderr, result.stderr
