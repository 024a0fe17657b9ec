"""The master's small HTTP endpoint: /metrics, /healthz, /api/v1/slots, /api/v1/host.

The stdlib server in one daemon thread, not uvicorn: the master forks slots all the
time, and a thread that only blocks in accept() and writes to its own socket is the
least that can be inherited by a fork in a bad state. Read-only (other methods: 405);
binds 127.0.0.1 by default, and then answers only loopback Host headers (DNS rebinding).
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from master.supervisor import RESTART_REASONS, Snapshot
from qcluster import metrics
from qcluster.security import ListenAddress, host_header_is_loopback

Getter = Callable[[], Snapshot]


class MasterCollector:
    """The master's own gauges, computed from the latest snapshot at scrape time."""

    def __init__(self, snapshot: Getter, host: str) -> None:
        self.snapshot = snapshot
        self.host = host

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snap = self.snapshot()
        sample = snap.sample
        yield GaugeMetricFamily("qcluster_host_capacity_slots", "Slots this host can run now.",
                                value=snap.capacity_slots)
        if sample is not None:
            yield GaugeMetricFamily("qcluster_host_mem_available_bytes",
                                    "MemAvailable (or the cgroup's free memory).",
                                    value=sample.mem_available_bytes)
            pss = sample.master_pss_bytes + sum(sample.slot_pss_bytes)
            yield GaugeMetricFamily("qcluster_host_pss_total_bytes",
                                    "PSS of the master and its slots.", value=pss)
        slots = GaugeMetricFamily("qcluster_slots", "Slots by queue and state.",
                                  labels=["queue", "state"])
        counts: dict[tuple[str, str], int] = {}
        for info in snap.slots:
            counts[(info.queue, info.state)] = counts.get((info.queue, info.state), 0) + 1
        for (queue, state), n in sorted(counts.items()):
            slots.add_metric([queue, state], n)
        yield slots
        yield from self._per_slot(snap)
        restarts = CounterMetricFamily("qcluster_slot_restarts_total",
                                       "Slot restarts by queue and reason.",
                                       labels=["queue", "reason"])
        queues = {q for q, _ in snap.restarts} | {i.queue for i in snap.slots}
        for queue in sorted(queues):
            for reason in RESTART_REASONS:
                restarts.add_metric([queue, reason], snap.restarts.get((queue, reason), 0))
        yield restarts

    def _per_slot(self, snap: Snapshot) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        labels = ["slot", "queue"]
        pss = GaugeMetricFamily("qcluster_slot_pss_bytes", "PSS of each slot.", labels=labels)
        dirty = GaugeMetricFamily("qcluster_slot_private_dirty_bytes",
                                  "Private_Dirty of each slot.", labels=labels)
        seen = GaugeMetricFamily("qcluster_slot_last_seen_timestamp_seconds",
                                 "Last message from each slot (unix time).", labels=labels)
        for info in snap.slots:
            key = [str(info.slot_no), info.queue]
            pss.add_metric(key, info.pss_bytes)
            dirty.add_metric(key, info.private_dirty_bytes)
            seen.add_metric(key, snap.last_seen.get(info.slot_no, 0.0))
        yield from (pss, dirty, seen)


def build_registry(snapshot: Getter, host: str) -> Any:
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    if metrics.multiprocess_enabled():
        MultiProcessCollector(registry)
    registry.register(MasterCollector(snapshot, host))
    return registry


def host_json(snap: Snapshot) -> dict[str, Any]:
    sample = snap.sample
    return {
        "cpus": sample.cpus if sample else os.cpu_count(),
        "loadavg": list(os.getloadavg()),
        "mem_available_bytes": sample.mem_available_bytes if sample else 0,
        "pss_total_bytes": (sample.master_pss_bytes + sum(sample.slot_pss_bytes)) if sample else 0,
        "avg_slot_pss_bytes": snap.avg_slot_pss_bytes,
        "capacity_slots": snap.capacity_slots,
        "desired": snap.desired,
    }


def serve(listen: ListenAddress, snapshot: Getter, host: str) -> ThreadingHTTPServer:
    """Start the endpoint in a daemon thread; returns the server (its socket for the fork)."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    registry = build_registry(snapshot, host)
    loopback = listen.loopback

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if loopback and not host_header_is_loopback(self.headers.get("Host")):
                self._json({"detail": "invalid host header"}, 400)
                return
            path = self.path.split("?")[0]
            if path == "/metrics":
                self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                self._json({"status": "ok", "host": host})
            elif path == "/api/v1/slots":
                self._json([info.model_dump() for info in snapshot().slots])
            elif path == "/api/v1/host":
                self._json(host_json(snapshot()))
            else:
                self._json({"detail": "not found"}, 404)

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

    server_class = _IPv6Server if ":" in listen.host else ThreadingHTTPServer
    server = server_class((listen.host, listen.port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="master-http", daemon=True).start()
    return server


class _IPv6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6
