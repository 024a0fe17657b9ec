"""SIGTERM stops a real ``qcluster manager`` within a few seconds whatever its clients do:
here one trickles a request body (the issue saw the manager keep running for as long as
such a client did)."""

from __future__ import annotations

import signal
import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from qcluster.manager.api.serving import BODY_TIMEOUT_S, SHUTDOWN_GRACE_S
from tests.conftest import free_port, wait_until
from tests.e2e.cluster import Procs, try_json

#: Well under the body deadline: the trickling request is still open when the manager
#: must have exited (a manager that waits for it is still running).
STOP_WAIT_S = BODY_TIMEOUT_S * 3 / 4
assert STOP_WAIT_S > 4 * SHUTDOWN_GRACE_S


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    running = Procs(tmp_path, {"QC_TEST_PREFIX": f"s{uuid.uuid4().hex[:8]}",
                               "QC_TEST_LOG_DIR": str(tmp_path)})
    yield running
    running.stop_all()


def test_sigterm_stops_the_manager_while_a_client_trickles_a_body(
    procs: Procs, redis_url: str
) -> None:
    """Fails on the code before: uvicorn waited for the open request without end."""
    port = free_port()
    manager = procs.start("manager", "manager", "--broker", redis_url, "--listen", str(port))
    wait_until(lambda: try_json(port, "/healthz"), timeout_s=60, message="manager up")
    done = threading.Event()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"POST /api/v1/reports HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n")

        def trickle() -> None:
            while not done.wait(0.2):
                try:
                    sock.sendall(b" ")
                except OSError:
                    return

        thread = threading.Thread(target=trickle, daemon=True)
        thread.start()
        try:
            done.wait(1.0)  # the body is on its way
            manager.send_signal(signal.SIGTERM)
            code = manager.wait(timeout=STOP_WAIT_S)
        finally:
            done.set()
            thread.join()
    log = procs.log("manager")
    assert code in (0, -signal.SIGTERM), log  # (uvicorn raises the signal it caught again)
    assert "Traceback" not in log, log
