"""The embedded broker's life: started by the first qcluster process that needs it, stopped
by the last one of those to exit, never started by a command that only reads.

Every process that opens the embedded broker (:func:`hold`, called by ``open_embedded``)
keeps a shared ``flock`` on ``<state dir>/embedded.users`` for as long as it lives. On its
way out (``atexit``: a normal exit, Ctrl-C, SIGTERM turned into an exit) it asks for the
lock exclusively without waiting: it gets it only when no other process holds its share,
and then it shuts the server down (saving its data first). A process killed by SIGKILL
releases its share (the kernel does) but stops nothing: the next last user, or
``qcluster broker stop``, does. A process that opens the broker while the last user is
stopping it waits for the stop (its shared lock waits for the exclusive one), then starts
a fresh server.

Read-only commands (``qcluster stats``, ``dead``, ``job``...) use :func:`open_running`: it
connects to a server that runs, and says none does otherwise (BrokerUnavailable).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from qcluster.broker.embedded import _answers, socket_path, stop_embedded
from qcluster.broker.redis_broker import RedisBroker
from qcluster.errors import BrokerUnavailable, ConfigError

USERS_FILE = "embedded.users"
PID_FILE = "redis.pid"


@dataclass
class _Hold:
    fd: int
    pid: int


_holds: dict[Path, _Hold] = {}
_registered_pid: list[int] = []


def hold(state_dir: Path) -> None:
    """Count this process as a user of the embedded broker of ``state_dir`` until it exits
    (or :func:`release`). Blocks while a last user is stopping the server.

    Raises:
        ConfigError: the state directory cannot be created or written (one line).
    """
    key = state_dir.resolve()
    current = _holds.get(key)
    if current is not None and current.pid == os.getpid():
        return
    try:
        key.mkdir(parents=True, exist_ok=True)
        fd = os.open(key / USERS_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise ConfigError(f"the embedded broker's state directory {str(key)!r} is not "
                          f"usable: {exc.strerror or exc}") from None
    fcntl.flock(fd, fcntl.LOCK_SH)
    _holds[key] = _Hold(fd, os.getpid())
    if os.getpid() not in _registered_pid:  # a forked child registers its own
        _registered_pid.append(os.getpid())
        atexit.register(release_all)


def release(state_dir: Path) -> bool:
    """This process no longer uses the broker; the last user stops it. True: stopped."""
    current = _holds.pop(state_dir.resolve(), None)
    if current is None or current.pid != os.getpid():
        return False  # a forked child never releases its parent's share
    try:
        try:
            fcntl.flock(current.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # another process uses it
        return stop_embedded(state_dir)
    finally:
        os.close(current.fd)


def release_all() -> None:
    for state_dir in list(_holds):
        with contextlib.suppress(Exception):  # at exit: never a traceback over another
            release(state_dir)


def running(state_dir: Path) -> bool:
    """Whether the embedded broker of ``state_dir`` answers (nothing is started)."""
    return _answers(socket_path(state_dir))


def open_running(state_dir: Path) -> RedisBroker:
    """The embedded broker of ``state_dir`` if it runs; never starts one.

    Raises:
        BrokerUnavailable: none runs there (one line naming the directory).
    """
    sock = socket_path(state_dir)
    if not _answers(sock):
        raise BrokerUnavailable(
            f"no embedded broker is running in {state_dir.resolve()} (start "
            "a manager or master here, or give --broker URL / QCLUSTER_BROKER_URL)")
    broker = RedisBroker.from_url(f"unix://{sock}")
    broker.safe_url = f"embedded://{state_dir.resolve()}"
    return broker


def server_pid(state_dir: Path) -> int | None:
    """The running server's pid (from its pid file), or None."""
    try:
        return int((state_dir.resolve() / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def users(state_dir: Path) -> list[int]:
    """The pids holding a share of the broker of ``state_dir`` (Linux /proc/locks)."""
    try:
        inode = os.stat(state_dir.resolve() / USERS_FILE).st_ino
        text = Path("/proc/locks").read_text()
    except OSError:
        return []
    pids = set()
    for line in text.splitlines():
        fields = line.split()
        if "->" in fields:  # a waiter: "1: -> FLOCK ..."
            fields.remove("->")
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5].endswith(f":{inode}"):
            with contextlib.suppress(ValueError):
                pids.add(int(fields[4]))
    return sorted(pids - {os.getpid()})
