"""What KombuBroker and amqp_readahead need from kombu and py-amqp beyond their documented
API. Each test names the internal it checks: when an upgrade changes
one, this fails loudly here instead of somewhere deep in a slot.

Kept for speed or robustness (and why), everything else is public API:
- ``amqp.serialization.pstr_t`` is replaced (amqp_readahead.scoped_str: lenient_str while
  one of qcluster's connections reads a frame, py-amqp's own elsewhere): py-amqp decodes
  every short string strictly, and one bad byte stopped a consumer forever.
  ``amqp.Connection.drain_events`` is overridden to mark that scope, and kombu's
  ``pyamqp.SSLTransport.Connection`` is the hook for TLS connections. The override reads
  ``_transport`` and calls ``blocking_read`` and ``on_inbound_frame`` itself, so that a
  frame already buffered is parsed without py-amqp's ``having_timeout`` (two ``ioctl``
  calls per frame), and the consumers' drain handles every buffered frame in one call.
- ``amqp.transport.TCPTransport`` is subclassed, overriding ``read_frame`` and ``connect``
  and reading ``sock`` / ``raise_on_initial_eintr`` / ``connected`` (a third of a slot's
  CPU on RabbitMQ was py-amqp's three recv calls per frame); ``amqp.Connection.Transport``
  and kombu's ``pyamqp.Transport.Connection`` are the hooks that install it.
- ``amqp.Connection.on_blocked`` / ``on_unblocked`` are set on the live connection after
  kombu made it (kombu passes neither): RabbitMQ's resource alarms block publishing, and
  the log and the publish's error say so (amqp_link.AmqpLink).
- kombu's native delayed delivery helpers (public functions of a module kombu documents
  only through Celery) build each queue's delay ladder.
The versions these were checked with are pinned in pyproject.toml (upper bounds).
"""

from __future__ import annotations

import inspect
import struct
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import amqp
import amqp.connection
import amqp.serialization
import amqp.transport
import kombu
import pytest
from kombu.transport import native_delayed_delivery as ndd
from kombu.transport import pyamqp

from qcluster.broker import amqp_readahead, open_broker
from qcluster.broker.amqp_readahead import ReadAheadTCPTransport, scoped_str
from qcluster.broker.kombu_broker import KombuBroker

#: The ranges these tests passed with; pyproject.toml pins the same upper bounds.
TESTED = {"kombu": ((5, 5), (5, 8)), "amqp": ((5, 2), (5, 5))}


def _major_minor(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


@pytest.mark.parametrize("package", sorted(TESTED))
def test_installed_versions_are_the_tested_ones(package: str) -> None:
    low, high = TESTED[package]
    installed = _major_minor(version(package))
    assert low <= installed < high, (
        f"{package} {version(package)} is outside {low} <= version < {high}, the range "
        "tests/contract/test_kombu_internals.py was checked with: run this file, then "
        "widen TESTED here and the pin in pyproject.toml")


@pytest.fixture
def broker(rabbitmq_url: str) -> Iterator[KombuBroker]:
    opened = open_broker(rabbitmq_url)
    assert isinstance(opened, KombuBroker)
    yield opened
    opened.close()


# --- amqp.serialization.pstr_t --------------------------------------------------------


def test_py_amqp_decodes_property_and_header_strings_through_pstr_t() -> None:
    assert amqp.serialization.pstr_t is scoped_str, (
        "amqp.serialization.pstr_t is not amqp_readahead.scoped_str: the patch was undone")
    bad = b"id-\xff\xfe"
    table = bytes([3]) + b"k\xffy" + b"S" + struct.pack(">I", len(bad)) + bad
    buf = (struct.pack(">H", 0x2000 | 0x0080)  # application_headers, message_id
           + struct.pack(">I", len(table)) + table + bytes([len(bad)]) + bad)
    with pytest.raises(UnicodeDecodeError):  # outside qcluster's connections: py-amqp's own
        amqp.serialization.decode_properties_basic(buf, 0)
    token = amqp_readahead._LENIENT.set(True)  # as while _AMQPConnection.drain_events runs
    try:
        properties, _ = amqp.serialization.decode_properties_basic(buf, 0)
    except UnicodeDecodeError as exc:
        pytest.fail(f"py-amqp no longer reads strings through amqp.serialization.pstr_t "
                    f"(patched by qcluster.broker.amqp_readahead): {exc}")
    finally:
        amqp_readahead._LENIENT.reset(token)
    assert properties["message_id"] == bad.decode("utf-8", "surrogateescape")
    assert properties["application_headers"] == {
        "k\udcffy": bad.decode("utf-8", "surrogateescape")}


# --- amqp.transport.TCPTransport, subclassed -------------------------------------------


def _line_of(function: object, text: str) -> int:
    """The file line number of the first line of ``function`` holding ``text``."""
    lines, first = inspect.getsourcelines(function)  # type: ignore[arg-type]
    return first + next(i for i, line in enumerate(lines) if text in line)


def test_py_amqp_calls_the_blocked_callbacks_set_after_it_was_made() -> None:
    """AmqpLink sets ``on_blocked`` / ``on_unblocked`` on the live connection (kombu passes
    neither): py-amqp must read them when Connection.Blocked / Unblocked arrive."""
    connection = amqp.Connection("127.0.0.1:1")  # never connected
    seen: list[str] = []
    connection.on_blocked = seen.append
    connection.on_unblocked = lambda: seen.append("unblocked")
    connection._callbacks[amqp.spec.Connection.Blocked]()
    connection._callbacks[amqp.spec.Connection.Unblocked]()
    assert seen == ["connection blocked, see broker logs", "unblocked"]
    assert amqp.connection.NEGOTIATE_CAPABILITIES["connection.blocked"]  # the broker tells it


def test_py_amqp_transport_hooks_the_read_ahead_transport_overrides() -> None:
    tcp = amqp.transport.TCPTransport
    for name in ("read_frame", "connect", "having_timeout"):
        assert callable(getattr(tcp, name, None)), f"amqp.transport.TCPTransport.{name} is gone"
    assert list(inspect.signature(tcp.read_frame).parameters) == ["self", "unpack"], (
        "amqp.transport.TCPTransport.read_frame(self, unpack=None) changed signature")
    wanted = ["host", "connect_timeout", "ssl", "read_timeout", "write_timeout"]
    got = list(inspect.signature(amqp.Connection.Transport).parameters)[1:6]
    assert got == wanted, f"amqp.Connection.Transport{got}: the read-ahead hook expects {wanted}"
    assert issubclass(pyamqp.Transport.Connection, amqp.Connection), (
        "kombu.transport.pyamqp.Transport.Connection is no longer py-amqp's Connection")
    assert callable(getattr(kombu.Connection, "get_transport_cls", None)), (
        "kombu.Connection.get_transport_cls is gone (amqp_readahead.Connection overrides it)")
    assert list(inspect.signature(amqp.Connection.drain_events).parameters) == [
        "self", "timeout"], "amqp.Connection.drain_events(self, timeout) changed"
    # The lenient decoder's scope (amqp_readahead._AMQPConnection.drain_events): py-amqp
    # reads and decodes every frame in blocking_read, which only drain_events calls.
    assert "on_inbound_frame" in inspect.getsource(amqp.Connection.blocking_read)
    # What _AMQPConnection._one_method reads and calls instead of drain_events' loop.
    assert "self._transport = None" in inspect.getsource(amqp.Connection.__init__)
    assert isinstance(inspect.getattr_static(amqp.Connection, "on_inbound_frame"), property)
    assert "while not self.blocking_read(timeout)" in inspect.getsource(
        amqp.Connection.drain_events), "amqp.Connection.drain_events reads differently now"
    package = Path(amqp.__file__).parent
    calls = [f"{path.name}:{number}" for path in sorted(package.glob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if "blocking_read(" in line and "def blocking_read" not in line]
    assert calls == [f"connection.py:{_line_of(amqp.Connection.drain_events, 'blocking_read(')}"], (
        f"py-amqp reads frames outside drain_events: {calls}")
    assert issubclass(pyamqp.SSLTransport, pyamqp.Transport), "kombu's pyamqp.SSLTransport"


def test_a_connection_reads_through_the_read_ahead_transport(broker: KombuBroker) -> None:
    broker.ping()
    connection = broker.conn.connection  # the py-amqp connection (public property)
    transport = connection.transport
    assert isinstance(transport, ReadAheadTCPTransport), (
        f"kombu built {type(transport).__name__}, not the read-ahead transport: "
        "kombu.Connection.get_transport_cls / amqp.Connection.Transport changed")
    for name in ("sock", "raise_on_initial_eintr", "connected"):
        assert hasattr(transport, name), f"amqp.transport.TCPTransport.{name} is gone"
    assert transport.connected and transport.sock.fileno() >= 0
    for name in ("send_heartbeat", "heartbeat_tick", "drain_events"):
        assert callable(getattr(connection, name, None)), f"amqp.Connection.{name} is gone"


# --- publishing: public calls only, checked for the behaviour the broker relies on --------


def test_basic_publish_does_not_wait_for_each_confirm(
    broker: KombuBroker, queue_name: str
) -> None:
    """Many publishes in flight, confirmed together: ``basic_publish`` must not read the
    socket (it would with kombu's confirm_publish option, one round trip per message)."""
    broker.publish(queue_name, "declare", b"{}")
    channel, confirms = broker.publisher.confirmed_channel()
    confirms.returned = []
    before = confirms.published
    for n in range(20):
        channel.basic_publish(amqp.Message(b"{}", message_id=f"m{n}"), exchange="",
                              routing_key=queue_name, mandatory=True)
        confirms.published += 1
    assert not confirms.all_confirmed(), (
        "amqp.Channel.basic_publish waited for confirms: was the connection opened with "
        "confirm_publish, or did py-amqp change basic_publish?")
    channel.basic_publish(amqp.Message(b"{}", message_id="lost"), exchange="",
                          routing_key=f"{queue_name}-nowhere", mandatory=True)
    confirms.published += 1
    while not confirms.all_confirmed():
        broker.link.drain(1.0)
    assert confirms.published - before == 21
    assert [m.properties.get("message_id") for m in confirms.returned] == ["lost"], (
        "amqp.Channel.events['basic_return'] no longer reports unroutable messages")
    assert broker.stats(queue_name).ready == 21


# --- kombu's native delayed delivery ----------------------------------------------------


def test_kombu_native_delayed_delivery_helpers() -> None:
    for name in ("declare_native_delayed_delivery_exchanges_and_queues",
                 "bind_queue_to_native_delayed_delivery_exchange", "calculate_routing_key",
                 "level_name"):
        assert callable(getattr(ndd, name, None)), (
            f"kombu.transport.native_delayed_delivery.{name} is gone (the delay ladders)")
    assert ndd.MAX_LEVEL == 27, "kombu's delay ladder no longer has 28 levels"
    assert isinstance(ndd.CELERY_DELAYED_DELIVERY_EXCHANGE, str)
    # The delay in seconds as 28 binary digits, then the queue's routing key.
    assert ndd.calculate_routing_key(5, "q") == ".".join(format(5, "028b")) + ".q", (
        "kombu.transport.native_delayed_delivery.calculate_routing_key changed its format")
