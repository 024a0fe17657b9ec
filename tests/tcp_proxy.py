"""A TCP proxy for tests that can blackhole its link: stop forwarding without closing.

A blackholed link is what a dead network path looks like to both ends (a cable pulled,
a firewall dropping packets, a NAT entry expired): nothing arrives and nothing fails.
A link that lost bytes stays silent after ``restore()``: TCP never resumes a stream with
a hole in it (a request lost there would be waited for forever while heartbeats flow), so
only links opened after the restore carry data again.
It can also reset every link (each end gets a TCP RST, as from a middlebox that dropped
its state) and delay everything it forwards (a slow path: latency, in order), or drop the
next reply and reset (the request reached the server, its reply never reaches the client).
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import suppress
from typing import Any
from urllib.parse import urlsplit

import redis


class TcpProxy:
    """Forwards ``127.0.0.1:port`` to ``target``; ``blackhole()`` silences every link,
    including ones opened afterwards, until ``restore()`` (a link that lost bytes stays
    silent); ``reset()`` aborts every open
    link with an RST; ``set_latency(s)`` delays each chunk forwarded from then on by ``s``
    seconds (0 to stop; ``restore()`` also ends it); ``cut_next_reply()`` drops the next
    chunk a server sends and resets every link (or with ``reset=False`` blackholes them,
    as ``blackhole()``): the command ran, its reply is lost."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._blackholed = threading.Event()
        self._reset = threading.Event()
        self._cut_reply = threading.Event()
        self._cut_resets = True
        self.replies_cut = 0
        #: The links' server ends: what they send is a reply.
        self._upstreams: set[socket.socket] = set()
        #: Sockets whose link lost bytes: silent for good (see the module's docstring).
        self._holed: set[socket.socket] = set()
        self._stopped = threading.Event()
        self._latency_s = 0.0
        #: Chunks held back by the latency: (due monotonic time, destination, data).
        self._pending: deque[tuple[float, socket.socket, bytes]] = deque()
        self.resets = 0
        self._links: list[tuple[socket.socket, socket.socket]] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name="tcp-proxy", daemon=True)
        self._thread.start()

    def blackhole(self) -> None:
        self._blackholed.set()

    def restore(self) -> None:
        self._blackholed.clear()
        self._latency_s = 0.0

    def reset(self, timeout_s: float = 10.0) -> None:
        """Abort every open link (both ends get an RST); returns once it is done. New
        connections are forwarded as usual."""
        self._reset.set()
        deadline = time.monotonic() + timeout_s
        while self._reset.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)

    def cut_next_reply(self, *, reset: bool = True) -> None:
        """The next chunk any server sends is dropped, and every link reset (RST), or
        silenced until ``restore()``."""
        self._cut_resets = reset
        self._cut_reply.set()

    def set_latency(self, seconds: float) -> None:
        self._latency_s = max(0.0, seconds)

    def close(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)
        self._listener.close()
        with self._lock:
            for a, b in self._links:
                a.close()
                b.close()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ, None)
        peers: dict[socket.socket, socket.socket] = {}
        while not self._stopped.is_set():
            if self._reset.is_set():
                self._abort_all(selector, peers)
                self._reset.clear()
            timeout = 0.05
            if self._pending:
                timeout = min(timeout, max(0.0, self._pending[0][0] - time.monotonic()))
            for key, _ in selector.select(timeout=timeout):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._listener:
                    client, _addr = self._listener.accept()
                    try:
                        upstream = socket.create_connection(self.target, timeout=5)
                    except OSError:
                        client.close()
                        continue
                    with self._lock:
                        self._links.append((client, upstream))
                    peers[client], peers[upstream] = upstream, client
                    self._upstreams.add(upstream)
                    selector.register(client, selectors.EVENT_READ, None)
                    selector.register(upstream, selectors.EVENT_READ, None)
                elif self._blackholed.is_set() or sock in self._holed:
                    self._drop(selector, peers, sock)
                else:
                    self._forward(selector, peers, sock)
            self._send_due()
        selector.close()

    def _send_due(self) -> None:
        now = time.monotonic()
        while self._pending and self._pending[0][0] <= now:
            _due, destination, data = self._pending.popleft()
            with suppress(OSError):  # the link closed meanwhile
                destination.sendall(data)

    def _abort_all(
        self, selector: selectors.BaseSelector, peers: dict[socket.socket, socket.socket],
    ) -> None:
        """SO_LINGER 0 then close: the kernel sends an RST instead of a FIN."""
        for sock in list(peers):
            with suppress(KeyError, ValueError):
                selector.unregister(sock)
            with suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        peers.clear()
        self._upstreams.clear()
        self._holed.clear()
        self._pending.clear()
        with self._lock:
            self._links.clear()
        self.resets += 1

    def _drop(
        self, selector: selectors.BaseSelector, peers: dict[socket.socket, socket.socket],
        sock: socket.socket,
    ) -> None:
        """Read and drop: the sender's writes succeed, nothing arrives. A side that
        closes is forgotten, and its peer is left open and silent (as a dead link is)."""
        try:
            if sock.recv(65536):
                self._hole(peers, sock)
                return
        except OSError:
            pass
        with suppress(KeyError, ValueError):
            selector.unregister(sock)
        other = peers.pop(sock, None)
        if other is not None:
            peers.pop(other, None)
            with suppress(KeyError, ValueError):
                selector.unregister(other)
        sock.close()

    def _hole(self, peers: dict[socket.socket, socket.socket], sock: socket.socket) -> None:
        """The link of ``sock`` lost bytes: both its ends stay silent from now on."""
        self._holed.add(sock)
        if sock in peers:
            self._holed.add(peers[sock])

    def _forward(
        self, selector: selectors.BaseSelector, peers: dict[socket.socket, socket.socket],
        sock: socket.socket,
    ) -> None:
        other = peers[sock]
        try:
            data = sock.recv(65536)
            if data and sock in self._upstreams and self._cut_reply.is_set():
                self._cut_reply.clear()
                self.replies_cut += 1
                if self._cut_resets:
                    self._abort_all(selector, peers)  # the reply is dropped with the links
                else:
                    self._blackholed.set()
                    self._hole(peers, sock)
                return
            if data:
                if self._latency_s > 0 or self._pending:  # in order behind held chunks
                    self._pending.append((time.monotonic() + self._latency_s, other, data))
                else:
                    other.sendall(data)
                return
        except OSError:
            pass
        for one in (sock, other):  # one side closed: close the link
            with suppress(KeyError, ValueError):
                selector.unregister(one)
            one.close()
            peers.pop(one, None)
            self._upstreams.discard(one)


@contextlib.contextmanager
def proxied_redis(redis_url: str, socket_timeout_s: float) -> Iterator[tuple[Any, TcpProxy]]:
    """A RedisBroker whose one connection goes through a proxy, with the retries every
    Redis client has and a short socket timeout (a test waits little for a reply that
    never comes); its scripts loaded and its pooled connection open before any cut."""
    from qcluster.broker.redis_broker import RedisBroker
    from qcluster.broker.redis_client import client_options

    parts = urlsplit(redis_url)
    with TcpProxy((parts.hostname or "127.0.0.1", parts.port or 6379)) as proxy:
        options = {**client_options(3), "socket_timeout": socket_timeout_s}
        client = redis.Redis(host="127.0.0.1", port=proxy.port, **options)
        broker = RedisBroker(client, safe_url="redis://proxied")
        for script in broker._scripts.values():  # loaded: a cut reply is the script's own
            client.script_load(script.script)
        client.ping()
        try:
            yield broker, proxy
        finally:
            broker.close()
