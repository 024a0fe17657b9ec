"""A TCP proxy for tests that can blackhole its link: stop forwarding without closing.

A blackholed link is what a dead network path looks like to both ends (a cable pulled,
a firewall dropping packets, a NAT entry expired): nothing arrives and nothing fails.
"""

from __future__ import annotations

import selectors
import socket
import threading
from contextlib import suppress


class TcpProxy:
    """Forwards ``127.0.0.1:port`` to ``target``; ``blackhole()`` silences every link,
    including ones opened afterwards, until ``restore()``."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._blackholed = threading.Event()
        self._stopped = threading.Event()
        self._links: list[tuple[socket.socket, socket.socket]] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name="tcp-proxy", daemon=True)
        self._thread.start()

    def blackhole(self) -> None:
        self._blackholed.set()

    def restore(self) -> None:
        self._blackholed.clear()

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
            for key, _ in selector.select(timeout=0.05):
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
                    selector.register(client, selectors.EVENT_READ, None)
                    selector.register(upstream, selectors.EVENT_READ, None)
                elif self._blackholed.is_set():
                    self._drop(selector, peers, sock)
                else:
                    self._forward(selector, peers, sock)
        selector.close()

    @staticmethod
    def _drop(
        selector: selectors.BaseSelector, peers: dict[socket.socket, socket.socket],
        sock: socket.socket,
    ) -> None:
        """Read and drop: the sender's writes succeed, nothing arrives. A side that
        closes is forgotten, and its peer is left open and silent (as a dead link is)."""
        try:
            if sock.recv(65536):
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

    @staticmethod
    def _forward(
        selector: selectors.BaseSelector, peers: dict[socket.socket, socket.socket],
        sock: socket.socket,
    ) -> None:
        other = peers[sock]
        try:
            data = sock.recv(65536)
            if data:
                other.sendall(data)
                return
        except OSError:
            pass
        for one in (sock, other):  # one side closed: close the link
            with suppress(KeyError, ValueError):
                selector.unregister(one)
            one.close()
            peers.pop(one, None)
