"""py-amqp with buffered socket reads: one ``recv`` per 64 KiB instead of three per frame.

py-amqp's TCP transport reads each frame with three exact-size ``recv`` calls (header,
payload, end octet), and a message is three frames: nine system calls per job, a third of
a slot's CPU on RabbitMQ. Here a frame is parsed out of a read-ahead buffer; bytes are
only consumed once a whole frame is there, so a read that times out (the normal way
``drain_events`` returns when idle) leaves the stream intact.

Only the plain-TCP py-amqp transport is replaced: ``amqps://`` (TLS) and librabbitmq
keep their own transports.

Also here: py-amqp decodes every short string and header value as strict UTF-8, so one
message with an invalid byte in its ``message_id`` or a header raised
``UnicodeDecodeError`` out of the frame reader, and the consumer stopped at that message
forever. On qcluster's own connections such strings are decoded with escapes
(:func:`lenient_str`) instead; the broker finds them (they cannot be encoded strictly
again) and hands the message out as malformed. py-amqp reads its decoder from a module
global (``amqp.serialization.pstr_t``), so that global becomes :func:`scoped_str`, which
is py-amqp's own decoder except while one of qcluster's connections reads a frame: any
other py-amqp connection in the process (an application's own) decodes as before.
"""

from __future__ import annotations

import errno
import select
import struct
from contextvars import ContextVar
from typing import Any

import kombu
from amqp import serialization
from amqp.exceptions import UnexpectedFrame
from amqp.transport import TCPTransport
from kombu.transport import pyamqp

#: How much to ask the kernel for at once.
CHUNK = 64 * 1024
_HEADER = struct.Struct(">BHI")  # frame type, channel, payload size
_FRAME_END = 0xCE
#: errnos after which the socket is still usable (as in py-amqp)
_RETRY = (errno.EAGAIN, errno.EINTR)
_UNAVAIL = {errno.EAGAIN, errno.EINTR, errno.ENOENT, errno.EWOULDBLOCK}


def lenient_str(value: Any) -> Any:
    """py-amqp's ``bytes_to_str``, except that invalid UTF-8 becomes lone surrogates
    (``surrogateescape``) instead of an exception that stops the whole connection."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            return value.decode("utf-8", "surrogateescape")
    return value


#: py-amqp's own decoder (``amqp.utils.bytes_to_str``): strict UTF-8.
STRICT_STR = serialization.pstr_t
_LENIENT: ContextVar[bool] = ContextVar("qcluster_amqp_lenient", default=False)


def scoped_str(value: Any) -> Any:
    """:func:`lenient_str` while a qcluster connection reads a frame, else py-amqp's own."""
    return lenient_str(value) if _LENIENT.get() else STRICT_STR(value)


# Used by py-amqp's property and header-table readers (a module global, read at call time).
serialization.pstr_t = scoped_str


class ReadAheadTCPTransport(TCPTransport):
    """py-amqp's TCP transport, reading frames from a read-ahead buffer.

    ``silence_limit_s``: py-amqp waits for a reply (queue.declare, basic.cancel, ...)
    with no timeout at all, so on a dead link (nothing arrives, nothing fails) such a
    wait never ends and no heartbeat check runs. With heartbeats on, the broker sends
    something at least every heartbeat; a blocking read that hears nothing for this
    long ends with ConnectionAbortedError (reads with a timeout are left alone)."""

    silence_limit_s: float | None = None
    _pending = b""
    """Received, not yet parsed."""
    _offset = 0
    """Where the unparsed part of _pending starts."""

    def connect(self) -> None:
        # A new socket: nothing of an earlier one is pending. (py-amqp sends the protocol
        # header inside connect; the broker's first frame is read afterwards.)
        if not self.connected:
            self._pending, self._offset = b"", 0
        super().connect()

    def _fill(self, need: int) -> None:
        """Make at least ``need`` unparsed bytes available."""
        while len(self._pending) - self._offset < need:
            if self.silence_limit_s and self.sock.gettimeout() is None:
                self._await_data(self.silence_limit_s)
            try:
                data = self.sock.recv(max(CHUNK, need))
            except OSError as exc:
                if exc.errno not in _RETRY:
                    raise
                if self.raise_on_initial_eintr:
                    # As py-amqp does before a frame's first byte; here no byte of the
                    # frame is consumed until all of it is in, so this holds anywhere.
                    raise TimeoutError() from exc
                continue
            if not data:
                raise OSError("Server unexpectedly closed connection")
            self._pending = self._pending[self._offset:] + data
            self._offset = 0

    def _await_data(self, limit_s: float) -> None:
        readable, _, _ = select.select([self.sock], [], [], limit_s)
        if not readable:
            # Not a TimeoutError (an OSError with ETIMEDOUT would become one): callers
            # take that for "no frame yet", while this link is dead.
            raise ConnectionAbortedError(
                errno.ECONNABORTED, f"nothing from the broker for {limit_s:g} s: the link is dead"
            )

    def buffered_frame(self) -> tuple[int, int, bytes] | None:
        """The next frame if all of it is buffered (read without touching the socket or
        its timeout), else None and nothing consumed."""
        pending, offset = self._pending, self._offset
        if len(pending) - offset < _HEADER.size:
            return None
        frame_type, channel, size = _HEADER.unpack_from(pending, offset)
        start = offset + _HEADER.size
        end = start + size
        if len(pending) <= end:
            return None
        if pending[end] != _FRAME_END:
            raise UnexpectedFrame(
                f"Received frame_end {pending[end]:#04x} while expecting 0xce")
        self._offset = end + 1
        return frame_type, channel, pending[start:end]

    def read_frame(self, unpack: Any = None) -> tuple[int, int, bytes]:
        try:
            self._fill(_HEADER.size)
            frame_type, channel, size = _HEADER.unpack_from(self._pending, self._offset)
            self._fill(_HEADER.size + size + 1)
        except TimeoutError:
            raise  # nothing consumed: the next read starts at the same frame
        except OSError as exc:
            if exc.errno not in _UNAVAIL:
                self.connected = False
            raise
        start = self._offset + _HEADER.size
        payload = self._pending[start:start + size]
        frame_end = self._pending[start + size]
        self._offset = start + size + 1
        if frame_end != _FRAME_END:
            raise UnexpectedFrame(f"Received frame_end {frame_end:#04x} while expecting 0xce")
        return frame_type, channel, payload


class _AMQPConnection(pyamqp.Connection):
    def drain_events(self, timeout: float | None = None) -> Any:
        """Every frame is read and decoded here (method arguments, message properties and
        headers): with escapes for invalid UTF-8, on this connection only. (Once per
        call, not per frame: a delivery is three frames.) Reads until one method is
        complete, as py-amqp does: a caller waiting for a reply (``basic_consume``
        registers its callback only once ConsumeOk is read) acts before the next one."""
        token = _LENIENT.set(True)
        try:
            transport = self._transport
            if not isinstance(transport, ReadAheadTCPTransport):
                return super().drain_events(timeout)
            self._one_method(transport, timeout)
            return None
        finally:
            _LENIENT.reset(token)

    def drain_buffered(self, timeout: float | None = None) -> None:
        """:meth:`drain_events`, then every frame already buffered: a 64 KiB read holds a
        few hundred deliveries, handled in one call instead of one call per delivery.
        Only for a caller that waits for no reply (a consumer reading its deliveries):
        every method read here is dispatched before it returns."""
        token = _LENIENT.set(True)
        try:
            transport = self._transport
            if not isinstance(transport, ReadAheadTCPTransport):
                super().drain_events(timeout)
                return
            self._one_method(transport, timeout)
            on_frame, buffered = self.on_inbound_frame, transport.buffered_frame
            while (frame := buffered()) is not None:
                on_frame(frame)
        finally:
            _LENIENT.reset(token)

    def _one_method(self, transport: ReadAheadTCPTransport, timeout: float | None) -> None:
        """Read frames until one method is complete. A frame already buffered is parsed
        without py-amqp's ``having_timeout``, which sets the socket's timeout and back
        (two ``ioctl`` system calls) around every frame."""
        on_frame, buffered = self.on_inbound_frame, transport.buffered_frame
        while True:
            frame = buffered()
            if frame is None:
                if self.blocking_read(timeout):
                    return
            elif on_frame(frame):
                return

    def Transport(self, host: str, connect_timeout: float | None, ssl: Any = False,
                  read_timeout: float | None = None, write_timeout: float | None = None,
                  **kwargs: Any) -> Any:
        if ssl:
            return super().Transport(host, connect_timeout, ssl, read_timeout, write_timeout,
                                     **kwargs)
        transport = ReadAheadTCPTransport(host, connect_timeout=connect_timeout,
                                          read_timeout=read_timeout,
                                          write_timeout=write_timeout, **kwargs)
        if self.client_heartbeat:
            # The broker sends a heartbeat at least every interval (RabbitMQ: half of it).
            transport.silence_limit_s = 2.0 * float(self.client_heartbeat) + 1.0
        return transport


class ReadAheadTransport(pyamqp.Transport):
    """kombu's py-amqp transport on :class:`ReadAheadTCPTransport`."""

    Connection = _AMQPConnection


class ReadAheadSSLTransport(pyamqp.SSLTransport):
    """kombu's py-amqp TLS transport (py-amqp's own reads) on qcluster's connection class:
    its frames are decoded as on a plain one."""

    Connection = _AMQPConnection


class Connection(kombu.Connection):
    """A kombu Connection that uses :class:`ReadAheadTransport` wherever kombu would use
    its plain py-amqp transport (:class:`ReadAheadSSLTransport` for its TLS one), including
    after a failover to the next URL (kombu re-reads the transport from each URL's
    scheme)."""

    def get_transport_cls(self) -> Any:
        transport_cls = super().get_transport_cls()
        if transport_cls is pyamqp.Transport:
            return ReadAheadTransport
        return ReadAheadSSLTransport if transport_cls is pyamqp.SSLTransport else transport_cls
