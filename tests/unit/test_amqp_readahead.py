"""The read-ahead AMQP transport parses the same frames as py-amqp, however the bytes are
cut by the network, and a read that times out mid-frame loses nothing; a blocking read on
a silent link ends; invalid UTF-8 in a message's strings is decoded, not fatal; connection
options in the URL are numbers."""

from __future__ import annotations

import itertools
import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import pytest
from amqp.exceptions import UnexpectedFrame
from hypothesis import given, settings
from hypothesis import strategies as st

from qcluster.broker.amqp_readahead import ReadAheadTCPTransport, lenient_str
from qcluster.broker.kombu_broker import URL_OPTIONS, split_url_options
from qcluster.errors import BrokerError

Frame = tuple[int, int, bytes]


def encode(frame: Frame, end: int = 0xCE) -> bytes:
    frame_type, channel, payload = frame
    return struct.pack(">BHI", frame_type, channel, len(payload)) + payload + bytes([end])


@contextmanager
def transport_on_socketpair() -> Iterator[tuple[ReadAheadTCPTransport, socket.socket]]:
    """The transport reading one end of a real socket pair; the test writes the other."""
    ours, theirs = socket.socketpair()
    transport = ReadAheadTCPTransport.__new__(ReadAheadTCPTransport)
    transport.sock = ours
    transport.connected = True
    transport.raise_on_initial_eintr = True
    transport._setup_transport()
    try:
        yield transport, theirs
    finally:
        ours.close()
        theirs.close()


#: larger than one 64 KiB read and than RabbitMQ's default frame_max (128 KiB)
big_payloads = st.builds(lambda n, shift: (bytes(range(256)) * 600)[shift:shift + n],
                         st.integers(70_000, 140_000), st.integers(0, 255))
frames = st.lists(
    st.tuples(st.sampled_from([1, 2, 3, 8]), st.integers(0, 3),
              st.binary(max_size=300) | big_payloads),
    min_size=1, max_size=8,
)


@settings(max_examples=60, deadline=None)
@given(frames=frames, cuts=st.lists(st.integers(1, 200_000), max_size=12))
def test_frames_survive_any_split_and_timeouts_between_the_pieces(
    frames: list[Frame], cuts: list[int]
) -> None:
    stream = b"".join(map(encode, frames))
    points = [0, *sorted({c % len(stream) for c in cuts} - {0}), len(stream)]
    pieces = [stream[a:b] for a, b in itertools.pairwise(points)]
    got: list[Frame] = []
    with transport_on_socketpair() as (transport, peer):
        transport.sock.settimeout(0.001)  # reads time out between (and inside) pieces
        writer = threading.Thread(target=send_slowly, args=(peer, pieces))
        writer.start()
        deadline = time.monotonic() + 60
        while len(got) < len(frames) and time.monotonic() < deadline:
            with suppress(socket.timeout):
                got.append(transport.read_frame())
        writer.join()
    assert got == frames


def send_slowly(peer: socket.socket, pieces: list[bytes]) -> None:
    for piece in pieces:
        peer.sendall(piece)
        time.sleep(0.002)


def test_a_bad_frame_end_is_an_error() -> None:
    with transport_on_socketpair() as (transport, peer):
        peer.sendall(encode((1, 0, b"abc"), end=0x00))
        with pytest.raises(UnexpectedFrame):
            transport.read_frame()


def test_a_closed_connection_is_an_error_not_a_hang() -> None:
    with transport_on_socketpair() as (transport, peer):
        peer.sendall(encode((1, 0, b"abc"))[:5])
        peer.shutdown(socket.SHUT_WR)
        with pytest.raises(OSError, match="closed"):
            transport.read_frame()


def test_a_blocking_read_on_a_silent_link_ends_as_a_dead_link_not_a_timeout() -> None:
    with transport_on_socketpair() as (transport, peer):
        transport.sock.settimeout(None)  # how py-amqp waits for a reply: no timeout at all
        transport.silence_limit_s = 0.2
        with pytest.raises(ConnectionAbortedError, match="link is dead") as caught:
            transport.read_frame()
        assert not isinstance(caught.value, TimeoutError), "a timeout reads as 'no frame yet'"
        peer.sendall(encode((8, 0, b"")))  # a heartbeat in time: the read goes on
        assert transport.read_frame() == (8, 0, b"")


@given(raw=st.binary(max_size=64))
def test_any_bytes_decode_and_only_invalid_utf8_is_escaped(raw: bytes) -> None:
    text = lenient_str(raw)
    try:
        assert text == raw.decode("utf-8", "surrogatepass")  # py-amqp's own decoding
    except UnicodeDecodeError:
        assert text.encode("utf-8", "surrogateescape") == raw  # nothing lost
        with pytest.raises(UnicodeEncodeError):
            text.encode("utf-8")  # so the broker can tell it is malformed


@given(seconds=st.floats(0, 3600), other=st.sampled_from(["", "ssl=1", "x=a%20b"]))
def test_connection_options_come_out_of_the_url_as_numbers(seconds: float, other: str) -> None:
    query = "&".join(q for q in (f"heartbeat={seconds!r}", other) if q)
    url, options = split_url_options(f"amqp://u:p@h:1/v?{query};amqp://h2//")
    assert options["heartbeat"] == seconds
    assert options["connect_timeout"] == URL_OPTIONS["connect_timeout"]
    assert url == f"amqp://u:p@h:1/v{'?' + other if other else ''};amqp://h2//"


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "soon", "", "3601"])
def test_a_bad_connection_option_is_one_clear_error(value: str) -> None:
    with pytest.raises(BrokerError, match=f"connect_timeout={value!r}"):
        split_url_options(f"amqp://h//?connect_timeout={value}")


@settings(max_examples=40, deadline=None)
@given(frames=frames, partial=st.binary(min_size=1, max_size=6))
def test_a_frame_said_ready_is_read_from_the_buffer_alone(frames: list[Frame],
                                                          partial: bytes) -> None:
    """``buffered_frame`` returns a frame exactly while all of it is buffered, without the
    socket (the connection's drain parses it without setting the socket's timeout), and
    leaves a partial one for the next read."""
    with transport_on_socketpair() as (transport, peer):
        assert transport.buffered_frame() is None
        stream = b"".join(map(encode, frames))
        writer = threading.Thread(target=peer.sendall, args=(stream + partial,))
        writer.start()
        got = [transport.read_frame()]
        consumed, total = len(encode(frames[0])), len(stream) + len(partial)
        while consumed + len(transport._pending) - transport._offset < total:  # all of it
            transport._fill(len(transport._pending) - transport._offset + 1)
        writer.join()
        sock, transport.sock = transport.sock, None  # any read of the socket now fails
        try:
            while (frame := transport.buffered_frame()) is not None:
                got.append(frame)
        finally:
            transport.sock = sock
        assert got == frames  # the partial frame after them is left
        assert len(transport._pending) - transport._offset == len(partial)


def test_a_bad_frame_end_in_the_buffer_is_an_error() -> None:
    with transport_on_socketpair() as (transport, peer):
        peer.sendall(encode((1, 0, b"ok")) + encode((1, 0, b"abc"), end=0x00))
        assert transport.read_frame() == (1, 0, b"ok")
        transport._fill(len(encode((1, 0, b"abc"))))  # all of the bad frame is buffered
        with pytest.raises(UnexpectedFrame):
            transport.buffered_frame()
