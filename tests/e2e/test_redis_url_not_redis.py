"""A Redis URL whose port is another service (the manager's admin page, any HTTP server):
the producer, the command line and the slots say that what answers does not speak Redis
and treat it as an unreachable broker, never as a refused ``CONFIG GET``."""

from __future__ import annotations

import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from qcluster import Client, exitcodes
from qcluster.errors import BrokerUnavailable
from tests.conftest import QCLUSTER, qcluster_env

NOT_REDIS = "does not speak Redis"


@pytest.fixture
def http_port() -> Iterator[int]:
    """A server that answers every connection with an HTTP error, as a web server does."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.1)  # accept() wakes to see the stop
    stop = threading.Event()

    def answer() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.recv(4096)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join(timeout=5)
        server.close()


def test_a_producer_is_told_the_port_does_not_speak_redis(http_port: int) -> None:
    """Client.enqueue raised a bare BrokerError (Protocol error, got "H" as reply type byte)
    after logging that CONFIG GET was not allowed."""
    client = Client(f"redis://127.0.0.1:{http_port}/0")
    with pytest.raises(BrokerUnavailable, match=NOT_REDIS):
        client.enqueue("emails", {})


def test_stats_on_a_port_that_is_not_redis_is_one_line_and_exit_5(
        http_port: int, tmp_path: Path) -> None:
    """It said 'durability not checked: CONFIG GET is not allowed' and a protocol error,
    exit 1 (an unexpected error)."""
    env = {k: v for k, v in qcluster_env().items() if not k.startswith("QCLUSTER_")}
    done = subprocess.run(
        [*QCLUSTER, "stats", "--broker", f"redis://127.0.0.1:{http_port}/0",
         "--manager", "http://127.0.0.1:9"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    output = (done.stdout + done.stderr).strip()
    assert done.returncode == exitcodes.BROKER_CONNECT, output
    assert len(output.splitlines()) == 1, output
    assert output.startswith("error: ") and NOT_REDIS in output, output
    assert "CONFIG GET" not in output
