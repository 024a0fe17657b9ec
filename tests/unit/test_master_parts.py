"""channel.send_parts / PartsReader: a message of any size over a SEQPACKET socket, read
without blocking (a reload template's answer, review finding 4)."""

from __future__ import annotations

import select
import socket
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qcluster.channel import MAX_PARTS_BYTES, PART_BYTES, PartsReader, send_parts


def read_all(reader: PartsReader, sock: socket.socket) -> bytes:
    """Read as the master does: whenever the socket is readable, until it is whole."""
    while True:
        try:
            return reader.read(sock)
        except BlockingIOError:
            select.select([sock], [], [], 5.0)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([0, 1, PART_BYTES - 1, PART_BYTES, PART_BYTES + 1, 3 * PART_BYTES,
                        600_000]), st.integers(0, 255))
def test_a_message_in_parts_comes_back_whole(size: int, fill: int) -> None:
    payload = bytes([fill]) * size
    sender, receiver = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with sender, receiver:
        receiver.setblocking(False)
        thread = threading.Thread(target=send_parts, args=(sender, payload))
        thread.start()  # blocks while the receiver's buffer is full
        reader = PartsReader()
        assert read_all(reader, receiver) == payload
        thread.join()
        send_parts(sender, b"next")  # the reader starts afresh after a whole message
        assert read_all(reader, receiver) == b"next"


def test_eof_and_what_is_not_a_message_in_parts() -> None:
    sender, receiver = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with receiver:
        sender.send(b'{"kind": "ready"}')
        with pytest.raises(ValueError, match="not a message in parts"):
            PartsReader().read(receiver)
        sender.close()
        assert PartsReader().read(receiver) == b""
    assert MAX_PARTS_BYTES >= 1 << 20
