"""The demo's progress line reads the manager's /api/v1/cluster: whatever answers on that
port, the line is printed (the demo then names the child that could not start)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from qcluster.demo.launcher import _summary


@contextlib.contextmanager
def serving(body: bytes) -> Iterator[str]:
    """A local HTTP server answering every GET with ``body`` (JSON); its base URL."""

    class Reply(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Reply)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("body", [b"{}", b'{"queues": 3}', b'{"queues": [{"name": "q"}]}',
                                  b"[]"])
def test_another_service_on_the_managers_port_reads_as_a_manager_starting(body: bytes) -> None:
    with serving(body) as url:
        assert _summary(url) == "manager starting..."


def test_the_managers_view_reads_as_slots_backlog_and_hosts() -> None:
    view = (b'{"queues": [{"name": "resize", "slots_current": 2, "slots_planned": 4, '
            b'"backlog": 120, "load": 0.5}], "hosts": [{"alive": true}, {"alive": false}]}')
    with serving(view) as url:
        assert _summary(url) == "resize 2/4 slots, backlog 120, load 50% | hosts 1"
