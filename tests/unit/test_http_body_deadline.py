"""Body trickle on the manager's HTTP server (issue: a body byte every 4 s was served after
40 s, and 499 such connections made everything else answer 503): a request's body has a
deadline that no trickle restarts, and a keep-alive connection does not live for ever. The
real server: the manager's app served by uvicorn with the manager's protocol, shortened
limits. The verdicts wait for the drop (bounded by DROP_LIMIT_S, far above the limits)."""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from qcluster.broker import open_broker
from qcluster.config import load_settings
from qcluster.manager.api.app import create_app
from qcluster.manager.api.serving import RequestDeadlineProtocol, uvicorn_options
from qcluster.manager.service import ManagerService
from qcluster.manager.state import ClusterState
from tests.unit.test_http_limits import DROP_LIMIT_S, HEAD_TIMEOUT_S, connect, get

BODY_TIMEOUT_S = 1.5
CONNECTION_MAX_S = 0.4
TOKEN = "s3cret-body-deadline-token"


@contextlib.contextmanager
def _serving(redis_url: str, header_timeout_s: float) -> Iterator[int]:
    """The manager's app on uvicorn with the manager's options, shortened; its port."""
    broker = open_broker(redis_url)
    service = ManagerService(ClusterState(load_settings(None)), broker, TOKEN)
    options = uvicorn_options(header_timeout_s, BODY_TIMEOUT_S)
    options["http"] = type("Short", (options["http"],), {"connection_max_s": CONNECTION_MAX_S})
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(service), **options))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    give_up = time.monotonic() + DROP_LIMIT_S
    while not server.started and thread.is_alive() and time.monotonic() < give_up:
        time.sleep(0.01)
    assert server.started
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(DROP_LIMIT_S)
        sock.close()
        broker.close()


@pytest.fixture(scope="module")
def manager_port(redis_url: str) -> Iterator[int]:
    with _serving(redis_url, HEAD_TIMEOUT_S) as port:
        yield port


def _report_head(length: int) -> bytes:
    return (b"POST /api/v1/reports HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % length)


def test_a_trickled_body_is_cut_at_its_deadline(manager_port: int) -> None:
    """Fails on the code before: a body byte every 0.1 s kept the request open for as long
    as it trickled (DROP_LIMIT_S here)."""
    with connect(manager_port) as sock:
        sock.sendall(_report_head(1 << 20))
        sock.settimeout(0.1)
        answer = b""
        give_up = time.monotonic() + DROP_LIMIT_S
        while time.monotonic() < give_up:
            try:
                sock.sendall(b" ")
                chunk = sock.recv(1024)
            except TimeoutError:
                continue
            except OSError:  # reset, broken pipe: dropped
                break
            if not chunk:
                break
            answer += chunk
        else:
            pytest.fail(f"a body trickled for {DROP_LIMIT_S} s and the request is open")
    assert answer.startswith(b"HTTP/1.1 408 "), answer


def test_a_busy_keep_alive_connection_is_closed_after_its_lifetime(manager_port: int) -> None:
    """Fails on the code before: a client that keeps asking (an idle connection is closed
    after the keep-alive timeout anyway) kept one connection for as long as it asked."""
    conn = http.client.HTTPConnection("127.0.0.1", manager_port, timeout=5)
    answered = 0
    try:
        give_up = time.monotonic() + DROP_LIMIT_S
        while time.monotonic() < give_up:
            try:
                assert get(conn)[0] == 200
            except (http.client.RemoteDisconnected, ConnectionError):
                break  # closed after its last answer
            answered += 1
            time.sleep(0.05)
        else:
            pytest.fail(f"one connection was answered for {DROP_LIMIT_S} s")
    finally:
        conn.close()
    assert answered > 1


def test_the_protocol_has_both_deadlines() -> None:
    options = uvicorn_options()
    assert issubclass(options["http"], RequestDeadlineProtocol)
    assert options["timeout_graceful_shutdown"] > 0


def test_the_master_never_waits_for_a_body() -> None:
    """The master's server reads no body (GET only; other methods: 405 and close), answers
    HTTP/1.0 and closes: a trickled body holds none of its threads."""
    from qcluster.master.http import serve
    from qcluster.master.snapshot import SupervisorSnapshot
    from qcluster.security import ListenAddress

    server = serve(ListenAddress("127.0.0.1", 0), SupervisorSnapshot, "h",
                   head_timeout_s=HEAD_TIMEOUT_S)
    try:
        for method in (b"POST", b"GET"):
            with connect(server.server_address[1]) as sock:
                sock.sendall(method + b" /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                             b"Content-Length: 100000\r\n\r\n")
                sock.settimeout(DROP_LIMIT_S)
                answer = b""
                while chunk := sock.recv(1024):  # it closes without reading the body
                    answer += chunk
                assert answer.startswith(b"HTTP/1.0 405 " if method == b"POST"
                                         else b"HTTP/1.0 200 "), answer
    finally:
        server.shutdown()
        server.server_close()
