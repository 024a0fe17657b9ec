"""The master's small HTTP endpoint: /metrics, /healthz, /api/v1/slots, /api/v1/host.

The stdlib server in one daemon thread, not uvicorn: the master forks slots all the
time, and a thread that only blocks in accept() and writes to its own socket is the
least that can be inherited by a fork in a bad state. Read-only (other methods: 405);
binds 127.0.0.1 by default, and then answers only loopback Host headers (DNS rebinding).
Bound off loopback (where a token is required at start), every route but /healthz (the
liveness probe) answers 401 without ``Authorization: Bearer TOKEN``.

Limits (slow loris): a connection has HEADER_TIMEOUT_S to send a complete request line +
headers, however slowly the bytes trickle in (it answers HTTP/1.0 and closes after each
answer: no idle keep-alive connection stays); at most MAX_CONNECTIONS are served at once
(one thread each), one more is answered 503 and closed at once.
"""

from __future__ import annotations

import glob
import io
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from qcluster import metrics
from qcluster.master.reload import RELOAD_RESULTS
from qcluster.master.slots import RESTART_REASONS
from qcluster.master.snapshot import SupervisorSnapshot
from qcluster.metrics import MASTER_METRICS_HELP
from qcluster.security import ListenAddress, bearer_token, host_header_is_loopback

Getter = Callable[[], SupervisorSnapshot]

#: Seconds a connection has to send a request's line + headers; also each read's and
#: each answer's write timeout.
HEADER_TIMEOUT_S = 10.0
#: Connections served at once (a thread each); more are refused with a 503.
MAX_CONNECTIONS = 64

_BUSY_REPLY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n"
               b"Connection: close\r\n\r\n")


class MasterCollector:
    """The master's own gauges, computed from the latest snapshot at scrape time."""

    def __init__(self, snapshot: Getter, host: str) -> None:
        self.snapshot = snapshot
        self.host = host

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        snap = self.snapshot()
        sample = snap.sample
        yield _gauge("qcluster_host_capacity_slots", value=snap.capacity_slots)
        if sample is not None:
            yield _gauge("qcluster_host_mem_available_bytes", value=sample.mem_available_bytes)
            yield _gauge("qcluster_host_pss_total_bytes", value=sample.pss_total_bytes)
        slots = _gauge("qcluster_slots", labels=["queue", "state"])
        counts: dict[tuple[str, str], int] = {}
        for info in snap.slots:
            counts[(info.queue, info.state)] = counts.get((info.queue, info.state), 0) + 1
        for (queue, state), n in sorted(counts.items()):
            slots.add_metric([queue, state], n)
        yield slots
        yield from self._per_slot(snap)
        name = "qcluster_slot_restarts_total"
        restarts = CounterMetricFamily(name, MASTER_METRICS_HELP[name], labels=["queue", "reason"])
        queues = {q for q, _ in snap.restarts} | {i.queue for i in snap.slots}
        for queue in sorted(queues):
            for reason in RESTART_REASONS:
                restarts.add_metric([queue, reason], snap.restarts.get((queue, reason), 0))
        yield restarts
        yield from _code_metrics(snap)

    def _per_slot(self, snap: SupervisorSnapshot) -> Iterator[Any]:
        labels = ["slot", "queue"]
        pss = _gauge("qcluster_slot_pss_bytes", labels=labels)
        dirty = _gauge("qcluster_slot_private_dirty_bytes", labels=labels)
        seen = _gauge("qcluster_slot_last_seen_timestamp_seconds", labels=labels)
        for info in snap.slots:
            key = [str(info.slot_no), info.queue]
            pss.add_metric(key, info.pss_bytes)
            dirty.add_metric(key, info.private_dirty_bytes)
            seen.add_metric(key, snap.last_seen.get(info.slot_no, 0.0))
        yield from (pss, dirty, seen)


def _code_metrics(snap: SupervisorSnapshot) -> Iterator[Any]:
    """The code the slots run, and reloads by result (master/reload.py)."""
    from prometheus_client.core import CounterMetricFamily

    code = snap.code
    info = _gauge("qcluster_master_code_info", labels=["version", "generation", "state"])
    info.add_metric([code.version, str(code.generation), code.state], 1)
    yield info
    yield _gauge("qcluster_master_old_slots", value=code.old_slots)
    name = "qcluster_master_reloads_total"
    reloads = CounterMetricFamily(name, MASTER_METRICS_HELP[name], labels=["result"])
    for result in RELOAD_RESULTS:
        reloads.add_metric([result], snap.reloads.get(result, 0))
    yield reloads


def _gauge(name: str, **kwargs: Any) -> Any:
    """A gauge of the master's, named and described in qcluster.metrics."""
    from prometheus_client.core import GaugeMetricFamily

    return GaugeMetricFamily(name, MASTER_METRICS_HELP[name], **kwargs)


def build_registry(snapshot: Getter, host: str) -> Any:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    if metrics.multiprocess_enabled():
        _settled_files_collector(registry)
    registry.register(MasterCollector(snapshot, host))
    return registry


def _settled_files_collector(registry: Any) -> None:
    """prometheus_client's multiprocess collector, minus the files a slot is creating this
    very moment: prometheus_client creates a file empty, then sizes it, and reading it
    empty raised ``struct.error``, so the scrape got no response at all."""
    from prometheus_client.multiprocess import MultiProcessCollector

    directory = os.environ[metrics.ENV_DIR]  # (set: multiprocess_enabled)

    class SettledFiles(MultiProcessCollector):
        def collect(self) -> Any:
            files = [path for path in glob.glob(os.path.join(directory, "*.db"))
                     if _size(path) > 0]
            return self.merge(files, accumulate=True)

    SettledFiles(registry, path=directory)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0  # removed since the glob: a slot that ended


def host_json(snap: SupervisorSnapshot) -> dict[str, Any]:
    sample = snap.sample
    return {
        "cpus": sample.cpus if sample else os.cpu_count(),
        "loadavg": list(os.getloadavg()),
        "mem_available_bytes": sample.mem_available_bytes if sample else 0,
        "pss_total_bytes": sample.pss_total_bytes if sample else 0,
        "avg_slot_pss_bytes": snap.avg_slot_pss_bytes,
        "capacity_slots": snap.capacity_slots,
        "desired": snap.desired,
        "fatal": snap.fatal,
        "code": snap.code.model_dump(),
    }


class _HeadDeadlineReader(io.RawIOBase):
    """The connection's reads, each bounded by what is left of the handler's deadline for
    the request head: a socket timeout alone restarts with every byte received."""

    def __init__(self, handler: _Handler) -> None:
        self.handler = handler

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        handler, sock = self.handler, self.handler.connection
        if handler.head_deadline is None:
            sock.settimeout(handler.timeout)
        else:
            left = handler.head_deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no complete request head in time")
            sock.settimeout(min(left, handler.timeout or left))
        return sock.recv_into(buffer)


class _Handler(BaseHTTPRequestHandler):
    """GET only; the endpoint's state is set on the subclass :func:`serve` makes."""

    snapshot: Getter
    health: Callable[[], dict[str, str]]
    registry: Any
    host: str
    loopback: bool
    token: str | None = None
    """Required off loopback (every route but /healthz)."""
    timeout = HEADER_TIMEOUT_S
    head_timeout_s: float = HEADER_TIMEOUT_S
    head_deadline: float | None = None

    def setup(self) -> None:
        super().setup()
        self.rfile = io.BufferedReader(_HeadDeadlineReader(self))

    def handle_one_request(self) -> None:
        """A request's head is due within head_timeout_s (a TimeoutError from the reader
        ends the connection: the stdlib catches it here)."""
        self.head_deadline = time.monotonic() + self.head_timeout_s
        super().handle_one_request()

    def parse_request(self) -> bool:
        try:
            return super().parse_request()  # reads the headers
        finally:
            self.head_deadline = None

    def do_GET(self) -> None:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if self.loopback and not host_header_is_loopback(self.headers.get("Host")):
            self._json({"detail": "invalid host header"}, 400)
            return
        path = self.path.split("?")[0]
        if path != "/healthz" and not self._authorized():
            self._json({"detail": "a valid token is required (Authorization: Bearer ...)"},
                       401)
            return
        if path == "/metrics":
            self._reply(200, generate_latest(self.registry), CONTENT_TYPE_LATEST)
        elif path == "/healthz":
            self._json({**self.health(), "host": self.host})
        elif path == "/api/v1/slots":
            self._json([info.model_dump() for info in self.snapshot().slots])
        elif path == "/api/v1/host":
            self._json(host_json(self.snapshot()))
        else:
            self._json({"detail": "not found"}, 404)

    def _authorized(self) -> bool:
        """Loopback: anyone on this machine may read. Off loopback: the token's holders."""
        if self.loopback:
            return True
        given = bearer_token(self.headers.get("Authorization"))
        return (self.token is not None and given is not None
                and secrets.compare_digest(given.encode(), self.token.encode()))

    def _read_only(self) -> None:
        self.send_response(405)
        self.send_header("Allow", "GET")
        self.send_header("Content-Length", "0")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True  # its body, if any, is never read

    do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _read_only

    def _json(self, body: Any, status: int = 200) -> None:
        self._reply(status, json.dumps(body).encode(), "application/json")

    def _reply(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # scrapes every few seconds would drown the log


def serve(listen: ListenAddress, snapshot: Getter, host: str,
          health: Callable[[], dict[str, str]] | None = None, *,
          head_timeout_s: float = HEADER_TIMEOUT_S,
          max_connections: int = MAX_CONNECTIONS,
          token: str | None = None) -> ThreadingHTTPServer:
    """Start the endpoint in a daemon thread; returns the server (its socket for the fork).
    ``health``: what /healthz says besides the host (default: ``{"status": "ok"}``).
    ``token``: what a request off loopback must bear (none: only /healthz answers there).
    ``head_timeout_s`` and ``max_connections``: the limits (tests shorten them)."""
    handler = type("Handler", (_Handler,), {
        "snapshot": staticmethod(snapshot), "registry": build_registry(snapshot, host),
        "health": staticmethod(health or (lambda: {"status": "ok"})),
        "host": host, "loopback": listen.loopback, "token": token,
        "head_timeout_s": head_timeout_s, "timeout": max(head_timeout_s, HEADER_TIMEOUT_S),
    })
    server_class = _IPv6Server if ":" in listen.host else _BoundedServer
    server = server_class((listen.host, listen.port), handler, max_connections)
    threading.Thread(target=server.serve_forever, name="master-http", daemon=True).start()
    return server


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most as many as ``connection_slots`` allows: one more
    is answered 503 and closed by the accepting thread, without blocking it."""

    daemon_threads = True
    block_on_close = False  # server_close() does not wait for a slow client's thread

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.connection_slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.connection_slots.acquire(blocking=False):
            try:
                request.setblocking(False)
                request.send(_BUSY_REPLY)
            except OSError:
                pass  # its buffer is full or it left: closed all the same
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.connection_slots.release()  # no thread started
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.connection_slots.release()


class _IPv6Server(_BoundedServer):
    address_family = socket.AF_INET6
