"""Where the controls live: Broker.write_control/read_controls on real Redis and RabbitMQ
(a second connection, as a restarted or second manager, reads what the first wrote; two
writers at once lose nothing), and the stored form (any bytes are read without a crash)."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qcluster.broker import open_broker
from qcluster.broker.base import Broker
from qcluster.controls import MAX_AT, Control, parse_stored, utc_text
from qcluster.manager.controls.store import ControlStore


@pytest.fixture(params=["redis", "rabbitmq"])
def url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(f"{request.param}_url"))


@pytest.fixture
def brokers(url: str) -> Iterator[tuple[Broker, Broker]]:
    first, second = open_broker(url), open_broker(url)
    yield first, second
    first.close()
    second.close()


def mine(controls: dict[str, Control] | None, tag: str) -> dict[str, Control]:
    """This test's controls (other tests share the broker)."""
    assert controls is not None
    return {key: c for key, c in controls.items() if tag in c.name}


def test_what_one_connection_writes_another_reads_back(brokers: tuple[Broker, Broker]) -> None:
    tag = uuid.uuid4().hex[:8]
    writer, reader = ControlStore(brokers[0]), ControlStore(brokers[1])
    paused = Control(kind="pause", name=f"q-{tag}", by="alice", at=1_800_000_000.5)
    drained = Control(kind="drain", name=f"h-{tag}", by="token", at=1_800_000_001.0)
    writer.set(paused)
    writer.set(drained)
    assert mine(reader.read(), tag) == {paused.key: paused, drained.key: drained}
    writer.clear("pause", paused.name)
    assert mine(reader.read(), tag) == {drained.key: drained}
    replaced = drained.model_copy(update={"by": "bob"})
    reader.set(replaced)  # the second manager changes it: the first one reads that
    assert mine(writer.read(), tag) == {drained.key: replaced}
    reader.clear("drain", drained.name)
    assert mine(writer.read(), tag) == {}


def test_two_writers_at_once_lose_no_control(url: str) -> None:
    tag = uuid.uuid4().hex[:8]
    per_writer = 15
    errors: list[BaseException] = []

    def write(writer_no: int) -> None:
        broker = open_broker(url)
        try:
            store = ControlStore(broker)
            for n in range(per_writer):
                store.set(Control(kind="pause", name=f"q-{tag}-{writer_no}-{n}",
                                  by=f"w{writer_no}", at=float(n)))
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)
        finally:
            broker.close()

    threads = [threading.Thread(target=write, args=(no,)) for no in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors
    reader = open_broker(url)
    try:
        found = mine(ControlStore(reader).read(), tag)
        assert len(found) == 2 * per_writer
        for control in found.values():
            ControlStore(reader).clear("pause", control.name)
    finally:
        reader.close()


@given(key=st.text(max_size=40), value=st.binary(max_size=200))
def test_any_stored_entry_is_a_control_or_skipped(key: str, value: bytes) -> None:
    control = parse_stored(key, value)
    if control is not None:
        assert control.key == key and control.kind in ("pause", "drain")


@given(at=st.floats(allow_nan=True, allow_infinity=True))
def test_a_stored_time_is_a_finite_date_or_the_entry_is_skipped(at: float) -> None:
    """The broker's data is not trusted: ``at`` must be finite within [0, MAX_AT], so that
    every control in force can be shown (as JSON and as a date) without an error."""
    control = parse_stored("pause:q", json.dumps({"by": "ops", "at": at}).encode())
    if control is None:
        assert not 0 <= at <= MAX_AT  # NaN compares False too
    else:
        assert control.at == at and utc_text(control.at)[:2] in ("19", "20")
    assert isinstance(utc_text(at), str)  # any number is shown, never an error


@given(name=st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,40}", fullmatch=True),
       by=st.text(max_size=30), at=st.floats(0, 4e9))
def test_a_stored_control_reads_back_the_same(name: str, by: str, at: float) -> None:
    for kind in ("pause", "drain"):
        control = Control(kind=kind, name=name, by=by, at=at)
        assert parse_stored(control.key, control.stored()) == control


def test_rabbitmq_a_writer_dead_between_publish_and_ack_leaves_the_newer_document_winning(
        rabbitmq_url: str) -> None:
    """A writer publishes the new document, then dies before acking the old one: the old one
    comes back beside the new. Readers and the next writer go by the newer version."""
    import json

    import amqp

    from qcluster.broker.kombu_broker import CONTROLS_QUEUE, KombuBroker

    tag = uuid.uuid4().hex[:8]
    broker = open_broker(rabbitmq_url)
    assert isinstance(broker, KombuBroker)
    store = ControlStore(broker)
    try:
        first = Control(kind="pause", name=f"q-{tag}-1", by="a", at=1.0)
        store.set(first)
        dying = broker.conn.channel()  # the writer that will die: holds the old document
        old = dying.basic_get(CONTROLS_QUEUE, no_ack=False)
        assert old is not None
        document = json.loads(old.body)
        second = Control(kind="pause", name=f"q-{tag}-2", by="b", at=2.0)
        document["controls"][second.key] = second.stored().decode()
        document["version"] += 1
        publisher = broker.conn.channel()
        publisher.basic_publish_confirm(amqp.Message(json.dumps(document), delivery_mode=2),
                                        exchange="", routing_key=CONTROLS_QUEUE)
        publisher.close()
        dying.close()  # died before its ack: the old document is back
        assert mine(store.read(), tag) == {first.key: first, second.key: second}
        third = Control(kind="drain", name=f"h-{tag}-3", by="c", at=3.0)
        store.set(third)
        assert mine(store.read(), tag) == {first.key: first, second.key: second,
                                           third.key: third}
        for control in (first, second, third):
            store.clear(control.kind, control.name)
    finally:
        broker.close()


def test_rabbitmq_a_write_while_another_process_holds_the_document_changes_nothing(
        rabbitmq_url: str) -> None:
    """A reader stalled mid-read (SIGSTOP, a cut link) holds the document: the queue looks
    empty. A writer refuses (BrokerUnavailable: the API answers 503) instead of writing a
    document with only its own control, which the length limit would keep over the held
    one when the reader lets go (every other pause and drain silently lifted)."""
    from qcluster.broker.kombu_broker import CONTROLS_QUEUE, KombuBroker
    from qcluster.errors import BrokerUnavailable

    tag = uuid.uuid4().hex[:8]
    broker, stalled = open_broker(rabbitmq_url), open_broker(rabbitmq_url)
    assert isinstance(stalled, KombuBroker)
    store = ControlStore(broker)
    paused = Control(kind="pause", name=f"q-{tag}-1", by="ops", at=1.0)
    drained = Control(kind="drain", name=f"h-{tag}-2", by="ops", at=2.0)
    later = Control(kind="pause", name=f"q-{tag}-3", by="ops", at=3.0)
    try:
        store.set(paused)
        store.set(drained)
        stalled.ping()
        reader = stalled.conn.channel()
        assert reader.basic_get(CONTROLS_QUEUE, no_ack=False) is not None
        with pytest.raises(BrokerUnavailable):
            store.set(later)
        reader.close()  # the reader lets go: its document comes back
        assert mine(store.read(), tag) == {paused.key: paused, drained.key: drained}
        store.set(later)  # now it is written on the whole document
        assert mine(store.read(), tag) == {paused.key: paused, drained.key: drained,
                                           later.key: later}
        for control in (paused, drained, later):
            store.clear(control.kind, control.name)
    finally:
        stalled.close()
        broker.close()
