"""The embedded broker uses nothing another user made: no predictable socket path in a
shared directory, and a state directory or socket that is not the user's alone is refused
with one line. Against real redis-server processes (a squatter started first)."""

from __future__ import annotations

import hashlib
import os
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from qcluster.broker.embedded import (
    MAX_SOCKET_PATH,
    ensure_server,
    open_embedded,
    redis_server_binary,
    stop_embedded,
)
from qcluster.errors import ConfigError


def _squatter(sock: Path) -> Iterator[redis.Redis]:
    """A redis-server someone started first on ``sock``, open to all (mode 777)."""
    server = subprocess.Popen(
        [redis_server_binary(), "--port", "0", "--unixsocket", str(sock),
         "--unixsocketperm", "777", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(unix_socket_path=str(sock))
    try:
        deadline = time.monotonic() + 10.0
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        yield client
    finally:
        client.close()
        server.kill()
        server.wait()
        sock.unlink(missing_ok=True)


@pytest.fixture
def long_state_dir(tmp_path: Path) -> Iterator[Path]:
    state_dir = tmp_path / ("s" * max(1, MAX_SOCKET_PATH - len(str(tmp_path)))) / "state"
    assert len(str(state_dir / "redis.sock")) > MAX_SOCKET_PATH
    yield state_dir
    stop_embedded(state_dir)


def test_a_long_state_dir_path_never_uses_a_predictable_socket(long_state_dir: Path) -> None:
    """Fails on the code before: the socket fell back to /tmp/qcluster-<sha1>.sock, and a
    redis-server another user started there first received the jobs."""
    resolved = str(long_state_dir.resolve() / "redis.sock")
    digest = hashlib.sha1(resolved.encode()).hexdigest()[:16]
    predictable = Path("/tmp") / f"qcluster-{digest}.sock"
    for squatter in _squatter(predictable):
        sock = ensure_server(long_state_dir)
        assert sock != predictable
        info = sock.parent.lstat()
        assert info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) == 0o700
        broker = open_embedded(long_state_dir)
        try:
            broker.publish("q", "j1", b'{"payload": 1}')
        finally:
            broker.close()
        assert squatter.dbsize() == 0, "the squatter received the user's job"
    assert ensure_server(long_state_dir) == sock  # every process finds the same server


def test_a_socket_open_to_others_in_the_state_dir_is_refused(tmp_path: Path) -> None:
    """Fails on the code before: whatever answered PING on the socket was used."""
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    for squatter in _squatter(state_dir / "redis.sock"):
        with pytest.raises(ConfigError) as refused:
            ensure_server(state_dir)
        message = str(refused.value)
        assert "\n" not in message and "socket" in message and "777" in message
        assert squatter.dbsize() == 0


def test_a_state_dir_writable_by_others_is_refused(tmp_path: Path) -> None:
    """Fails on the code before (a world-writable .qcluster/ was used as it was)."""
    state_dir = tmp_path / "shared"
    state_dir.mkdir()
    state_dir.chmod(0o777)
    with pytest.raises(ConfigError) as refused:
        ensure_server(state_dir)
    assert "\n" not in str(refused.value) and "writable by others" in str(refused.value)
    assert not (state_dir / "redis.sock").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory away needs root")
def test_a_state_dir_of_another_user_is_refused(tmp_path: Path) -> None:
    """Fails on the code before (another user's pre-made .qcluster/ was used)."""
    state_dir = tmp_path / "theirs"
    state_dir.mkdir(mode=0o755)
    os.chown(state_dir, 65534, 65534)
    with pytest.raises(ConfigError) as refused:
        ensure_server(state_dir)
    assert "\n" not in str(refused.value) and "uid 65534" in str(refused.value)


def test_a_new_state_dir_is_private(tmp_path: Path) -> None:
    state_dir = tmp_path / "new" / "state"
    try:
        sock = ensure_server(state_dir)
        assert stat.S_IMODE(state_dir.stat().st_mode) == 0o700
        with socket.socket(socket.AF_UNIX) as probe:
            probe.connect(str(sock))
    finally:
        stop_embedded(state_dir)


def test_stopping_the_embedded_broker_connects_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server closing the connection as it shuts down is the success: redis-py's
    default retries reconnected three times (3.6 s at each embedded CLI command's exit,
    `qcluster enqueue` took 4 s). Failed before the fix: 4 connections."""
    state_dir = tmp_path / "state"
    open_embedded(state_dir).close()
    connects: list[object] = []
    real_connect = redis.connection.UnixDomainSocketConnection._connect

    def counted(self: redis.connection.UnixDomainSocketConnection) -> object:
        connects.append(self)  # each socket opened, a retry's included
        return real_connect(self)

    monkeypatch.setattr(redis.connection.UnixDomainSocketConnection, "_connect", counted)
    assert stop_embedded(state_dir)
    assert len(connects) == 2  # the liveness check, then the shutdown: no reconnect
    assert not stop_embedded(state_dir)  # it no longer runs
