"""/healthz of the master: ok, or degraded while the broker's address does not answer
(chaos row F8 asks for it; the manager says the same)."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest

from qcluster.master.broker_health import BrokerConnectCheck, broker_addresses
from qcluster.master.effects import ProcessEffects


@pytest.mark.parametrize(("url", "expected"), [
    ("redis://h:7000/0", [(socket.AF_INET, ("h", 7000))]),
    ("redis://:secret@h", [(socket.AF_INET, ("h", 6379))]),
    ("rediss://h", [(socket.AF_INET, ("h", 6379))]),
    ("amqp://u:p@rabbit/vhost", [(socket.AF_INET, ("rabbit", 5672))]),
    ("amqps://rabbit", [(socket.AF_INET, ("rabbit", 5671))]),
    ("redis://[::1]:7001", [(socket.AF_INET6, ("::1", 7001))]),
    ("redis+socket:///run/redis.sock", [(socket.AF_UNIX, "/run/redis.sock")]),
    ("amqp://a;amqp://b:1", [(socket.AF_INET, ("a", 5672)), (socket.AF_INET, ("b", 1))]),
    # A host list (issue 17): any Cluster node, or any Sentinel, answering is the broker's
    # way in; urlsplit refused the list ("Port could not be cast") and /healthz said
    # degraded while the slots worked.
    ("redis+cluster://127.0.0.1:7000,127.0.0.1:7001",
     [(socket.AF_INET, ("127.0.0.1", 7000)), (socket.AF_INET, ("127.0.0.1", 7001))]),
    ("redis+cluster://127.0.0.1", [(socket.AF_INET, ("127.0.0.1", 6379))]),
    ("redis+sentinel://:pw@127.0.0.1:26379,[::1]:26380/mymaster",
     [(socket.AF_INET, ("127.0.0.1", 26379)), (socket.AF_INET6, ("::1", 26380))]),
])
def test_broker_addresses(url: str, expected: list[object]) -> None:
    assert broker_addresses(url, Path(".")) == expected


def test_embedded_is_its_unix_socket(tmp_path: Path) -> None:
    from qcluster.broker.embedded import socket_path

    expected = [(socket.AF_UNIX, str(socket_path(tmp_path)))]
    assert broker_addresses(None, tmp_path) == expected
    assert broker_addresses("embedded", tmp_path) == expected


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_degraded_while_the_broker_refuses_then_ok_again() -> None:
    port = _free_port()
    now = [0.0]
    health = BrokerConnectCheck(f"redis://127.0.0.1:{port}/0", Path("."), threading.Lock(),
                          clock=lambda: now[0])
    status = health.status()
    assert status["status"] == "degraded"
    assert status["broker"].startswith(f"cannot connect to 127.0.0.1:{port}: ")
    assert "\n" not in status["broker"]
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()
        assert health.status()["status"] == "degraded"  # the last check, cached for 1 s
        now[0] += 1.0
        assert health.status() == {"status": "ok"}


def test_the_check_holds_the_fork_lock_and_a_fork_waits_for_the_next_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    effects = ProcessEffects()
    forks: list[int] = []

    def fake_fork() -> int:
        forks.append(4242)
        return 4242

    monkeypatch.setattr(os, "fork", fake_fork)
    with effects.fork_lock:
        assert effects.fork("q", 0, lambda *a: 0) is None
    assert forks == []
    assert effects.fork("q", 0, lambda *a: 0) == 4242
    assert not effects.fork_lock.locked()
    effects.channels.forget(4242)


def test_healthz_says_degraded_with_the_reason() -> None:
    import http.client
    import json

    from qcluster.master.http import serve
    from qcluster.master.snapshot import SupervisorSnapshot
    from qcluster.security import ListenAddress

    reason = {"status": "degraded", "broker": "cannot connect to h:1: Connection refused"}
    server = serve(ListenAddress("127.0.0.1", 0), lambda: SupervisorSnapshot(), "h", lambda: reason)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=5)
        conn.request("GET", "/healthz")
        response = conn.getresponse()
        assert response.status == 200
        assert json.loads(response.read()) == {**reason, "host": "h"}
        conn.close()
    finally:
        server.shutdown()
