"""py-amqp's string decoder is lenient on qcluster's own connections only: a message with
invalid UTF-8 in its properties is read with escapes there (and handed out as malformed),
while any other py-amqp connection of the process (an application's own) decodes as
py-amqp does. On the real RabbitMQ."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import amqp
import kombu
import pytest

from qcluster.broker import amqp_readahead

BAD_ID = b"\xff-id-not-utf8"


@pytest.fixture
def bad_message_queue(rabbitmq_url: str, queue_name: str) -> Iterator[str]:
    """A queue of its own holding one message whose message_id is not UTF-8."""
    name = f"{queue_name}-decoder"
    with kombu.Connection(rabbitmq_url) as conn:
        channel = conn.channel()
        channel.queue_declare(name, durable=False, auto_delete=False)
        channel.basic_publish(amqp.Message(b"{}", message_id=BAD_ID), exchange="",
                              routing_key=name)
        channel.close()
    yield name
    with kombu.Connection(rabbitmq_url) as conn:
        conn.default_channel.queue_delete(name)


def test_qcluster_connections_read_it_with_escapes(rabbitmq_url: str,
                                                   bad_message_queue: str) -> None:
    with amqp_readahead.Connection(rabbitmq_url) as conn:
        channel = conn.channel()
        message = channel.basic_get(bad_message_queue, no_ack=False)
        assert message is not None
        assert message.properties["message_id"] == BAD_ID.decode("utf-8", "surrogateescape")
        channel.basic_reject(message.delivery_tag, requeue=True)
        channel.close()


def test_other_py_amqp_connections_decode_as_py_amqp_does(rabbitmq_url: str,
                                                          bad_message_queue: str) -> None:
    """Fails on the code before: importing qcluster's broker made every py-amqp connection
    in the process lenient (the decoder was replaced process-wide)."""
    assert "qcluster.broker.amqp_readahead" in sys.modules
    conn = kombu.Connection(rabbitmq_url)  # kombu's own py-amqp transport, not qcluster's
    try:
        channel = conn.channel()
        with pytest.raises(UnicodeDecodeError):
            channel.basic_get(bad_message_queue, no_ack=False)
    finally:
        with contextlib.suppress(Exception):  # py-amqp left the connection mid-frame
            conn.close()
