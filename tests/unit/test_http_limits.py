"""Slow loris on the manager's and the master's HTTP servers (issue 16, chaos row B5): a
connection whose request head never ends is dropped, an idle keep-alive connection too, the
master serves a bounded number of connections; normal clients and slow bodies are unharmed.

The real servers: the master's :func:`qcluster.master.http.serve`, and the manager's app
(:func:`create_app`) served by uvicorn with the manager's options
(:func:`qcluster.manager.api.serving.uvicorn_options`), each with a short head timeout. The
verdicts wait for the drop (bounded by DROP_LIMIT_S, far above the timeouts), never
measure how soon it came."""

from __future__ import annotations

import http.client
import inspect
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import h11
import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from qcluster.broker import open_broker
from qcluster.config import load_settings
from qcluster.manager.api.app import create_app
from qcluster.manager.api.serving import RequestDeadlineProtocol, uvicorn_options
from qcluster.manager.service import ManagerService
from qcluster.manager.state import ClusterState
from qcluster.master.http import serve
from qcluster.master.snapshot import SupervisorSnapshot
from qcluster.security import ListenAddress
from tests.unit.test_manager_state import report

HEAD_TIMEOUT_S = 0.8  # short for the tests' time; a normal request's head is sent at once
DROP_LIMIT_S = 30.0  # a server that keeps the connection this long has no limit
HEAD = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n"  # the blank line never comes
#: The uvicorn versions whose h11 protocol internals manager/api/serving.py was checked on
#: (pyproject pins the same range).
UVICORN_CHECKED = ((0, 29), (0, 55))


def dribble_until_dropped(sock: socket.socket) -> bytes:
    """One more byte of header every 0.1 s until the server ends the connection; what it
    answered before closing. Fails if the connection is still open after DROP_LIMIT_S."""
    sock.settimeout(0.1)
    answer = b""
    give_up = time.monotonic() + DROP_LIMIT_S
    while time.monotonic() < give_up:
        try:
            sock.sendall(b"X")
            chunk = sock.recv(1024)
        except TimeoutError:
            continue
        except OSError:  # reset, broken pipe: dropped
            return answer
        if not chunk:
            return answer
        answer += chunk
    pytest.fail(f"a request head dribbled for {DROP_LIMIT_S} s and the connection is open")


def silent_until_dropped(port: int) -> bytes:
    """A connection that sends nothing: what the server said before it closed it."""
    with connect(port) as sock:
        sock.settimeout(DROP_LIMIT_S)
        return sock.recv(1024)


def at_once(*calls: Callable[[], bytes]) -> list[bytes]:
    """Run the clients side by side (the waits overlap: the file stays fast)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [future.result() for future in [pool.submit(call) for call in calls]]


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def get(conn: http.client.HTTPConnection, path: str = "/healthz") -> tuple[int, bytes]:
    conn.request("GET", path, headers={"Host": "127.0.0.1"})
    response = conn.getresponse()
    return response.status, response.read()


# The master ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def master_port() -> Iterator[int]:
    server = serve(ListenAddress("127.0.0.1", 0), lambda: SupervisorSnapshot(), "h",
                   head_timeout_s=HEAD_TIMEOUT_S)
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_master_drops_a_request_head_that_never_ends(master_port: int) -> None:
    """Regression (chaos row B5): the master kept such a connection, and its thread, for
    ever. A connection that sends nothing ends the same way."""

    def dribbling() -> bytes:
        with connect(master_port) as sock:
            sock.sendall(HEAD)
            return dribble_until_dropped(sock)

    # the stdlib closes without an answer
    assert at_once(dribbling, lambda: silent_until_dropped(master_port)) == [b"", b""]


def test_master_answers_and_closes(master_port: int) -> None:
    """It answers HTTP/1.0 and closes after each answer: no idle keep-alive to hold."""
    with connect(master_port) as sock:
        sock.sendall(HEAD + b"\r\n")
        sock.settimeout(DROP_LIMIT_S)
        answer = b""
        while chunk := sock.recv(1024):
            answer += chunk
        assert answer.startswith(b"HTTP/1.0 200 ") and answer.endswith(b'"host": "h"}')


def test_master_refuses_connections_beyond_its_bound() -> None:
    """Each connection holds a thread: above max_connections, 503 and closed at once."""
    server = serve(ListenAddress("127.0.0.1", 0), lambda: SupervisorSnapshot(), "h",
                   head_timeout_s=DROP_LIMIT_S, max_connections=2)
    port = server.server_address[1]
    held = [connect(port), connect(port)]
    try:
        with connect(port) as third:
            third.settimeout(DROP_LIMIT_S)
            answer = b""
            while chunk := third.recv(1024):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 503 ")
        held.pop().close()  # a thread is free again once the server saw it go
        give_up = time.monotonic() + DROP_LIMIT_S
        while True:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            try:
                status = get(conn)[0]
            except (ConnectionError, http.client.RemoteDisconnected):
                status = 503
            finally:
                conn.close()
            if status == 200 or time.monotonic() > give_up:
                break
            time.sleep(0.05)
        assert status == 200
    finally:
        for sock in held:
            sock.close()
        server.shutdown()
        server.server_close()


# The manager -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def manager_port(redis_url: str) -> Iterator[int]:
    broker = open_broker(redis_url)
    service = ManagerService(ClusterState(load_settings(None)), broker, "s3cret")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(create_app(service), **uvicorn_options(HEAD_TIMEOUT_S))
    server = uvicorn.Server(config)
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


def test_manager_drops_a_request_head_that_never_ends(manager_port: int) -> None:
    """Regression (chaos row B5): uvicorn kept such a connection for ever, on a fresh
    connection, on a keep-alive one (the next request's head) and a silent one alike."""

    def dribbling() -> bytes:
        with connect(manager_port) as sock:
            sock.sendall(HEAD)
            return dribble_until_dropped(sock)

    def dribbling_after_two_requests() -> bytes:
        conn = http.client.HTTPConnection("127.0.0.1", manager_port, timeout=5)
        assert get(conn)[0] == 200
        assert get(conn)[0] == 200  # keep-alive works
        assert conn.sock is not None
        conn.sock.sendall(HEAD)
        try:
            return dribble_until_dropped(conn.sock)
        finally:
            conn.close()

    fresh, kept, silent = at_once(dribbling, dribbling_after_two_requests,
                                  lambda: silent_until_dropped(manager_port))
    assert fresh.startswith(b"HTTP/1.1 408 ") and kept.startswith(b"HTTP/1.1 408 ")
    assert silent == b""  # nothing was asked: closed without an answer


def test_manager_lets_a_slow_body_finish(manager_port: int) -> None:
    """The deadline is the head's: a body that takes longer than it is read whole."""
    body = json.dumps(report("slow-body-host", {}).model_dump(mode="json")).encode()
    head = (b"POST /api/v1/reports HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Authorization: Bearer s3cret\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    with connect(manager_port) as sock:
        sock.sendall(head)
        pieces = 3
        step = -(-len(body) // pieces)
        for start in range(0, len(body), step):
            time.sleep(HEAD_TIMEOUT_S / 2)  # 3 pauses: the body takes > 1 head timeout
            sock.sendall(body[start:start + step])
        response = http.client.HTTPResponse(sock)
        response.begin()
        assert response.status == 200, response.read()


def test_manager_options_bound_concurrency() -> None:
    options = uvicorn_options()
    assert options["http"] is RequestDeadlineProtocol and options["limit_concurrency"] > 0


def test_the_uvicorn_internals_the_deadline_relies_on_are_there() -> None:
    """manager/api/serving.py subclasses uvicorn's h11 protocol: an upgrade that renames what
    it uses fails here by name (and the tests above fail by behaviour)."""
    version = tuple(int(part) for part in uvicorn.__version__.split(".")[:2])
    low, high = UVICORN_CHECKED
    assert low <= version < high, (
        f"uvicorn {uvicorn.__version__} is outside the range manager/api/serving.py was checked "
        f"on ({low} <= v < {high}): check its H11Protocol use, then widen the range")
    for name, params in [("connection_made", ["transport"]), ("data_received", ["data"]),
                         ("on_response_complete", []), ("connection_lost", ["exc"]),
                         ("shutdown", [])]:
        method = getattr(H11Protocol, name, None)
        assert method is not None, f"uvicorn's H11Protocol has no {name}()"
        assert list(inspect.signature(method).parameters)[1:] == params, name
    source = inspect.getsource(H11Protocol)
    for attribute in ("self.conn = h11.Connection(", "self.transport = transport",
                      "self.loop = ", "self.client = "):
        assert attribute in source, f"uvicorn's H11Protocol no longer sets {attribute!r}"
    assert "self.on_response_complete" in source, "on_response_complete is no longer called"
    assert h11.IDLE is not None and hasattr(h11.Connection, "trailing_data")
    assert hasattr(h11.Connection, "their_state")
    assert "timeout_graceful_shutdown" in inspect.signature(uvicorn.Config).parameters
