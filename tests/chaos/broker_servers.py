"""Broker faults for the broker chaos rows (tests/chaos/test_broker_faults.py).

- :class:`RedisServer`: a ``redis-server`` of the test's own, in the foreground (so the test
  holds its pid), with its own data directory, that can be SIGKILLed and started again on
  the same port or unix socket with the same data; optionally inside a private mount
  namespace whose data directory is a small tmpfs (a disk that fills up).
- :func:`kill_embedded`: SIGKILL the embedded broker's daemonized server (its pidfile).
- :class:`RestartableRabbitMQ`: a private RabbitMQ node that stops and starts again on the
  same AMQP port with the same data.
- :func:`chaos_run`: the chaos suite's :class:`ChaosRun` on such a private broker, and a
  :class:`Feeder` that keeps enqueueing through the faults.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

import redis

from qcluster import Client
from tests.brokers import (
    START_TIMEOUT_S,
    BrokerUnavailable,
    PrivateRabbitMQ,
    _die_with_parent,
    _stop_group,
    _tail,
    free_port,
)
from tests.chaos.conftest import ChaosBroker, ChaosRun
from tests.chaos.ledger import LEDGER_ENV, Producer
from tests.conftest import wait_until
from tests.e2e.cluster import Procs


def wait_dead(pid: int, timeout_s: float = 30.0) -> None:
    """Until ``pid`` is gone or a zombie (the server is our child or a daemon)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} still runs {timeout_s:g} s after SIGKILL")


class RedisServer:
    """A foreground ``redis-server`` with its own data directory.

    ``aof`` and ``appendfsync`` as given; ``save`` as the embedded broker has it
    (``300 1``) unless told otherwise. ``unix_socket`` serves a socket instead of a TCP
    port. ``tmpfs_mb``: the data directory is a tmpfs of that size, mounted in a mount
    namespace of the row's own (``unshare --mount``) that a small holder process keeps
    alive across the server's kills and restarts (the server enters it with ``nsenter``);
    the test reaches it through ``/proc/HOLDER/root``; it ends with :meth:`stop`.
    """

    def __init__(self, base_dir: Path, *, aof: bool = True, appendfsync: str = "everysec",
                 save: str = "300 1", binary: str | None = None, unix_socket: bool = False,
                 port: int = 0, tmpfs_mb: int = 0, extra: tuple[str, ...] = ()) -> None:
        self.base_dir = base_dir
        self.data_dir = base_dir / "data"
        self.aof, self.appendfsync, self.save = aof, appendfsync, save
        self.binary = binary or shutil.which("redis-server") or "redis-server"
        self.socket = base_dir / "redis.sock" if unix_socket else None
        self.port = port
        self.tmpfs_mb = tmpfs_mb
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None
        self.holder: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.socket is not None:
            return f"unix://{self.socket}"
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def visible_data_dir(self) -> Path:
        """The data directory as this process sees it (through the server's mount
        namespace when it is a tmpfs of its own)."""
        if self.holder is not None:
            return Path(f"/proc/{self.holder.pid}/root") / str(self.data_dir).lstrip("/")
        return self.data_dir

    def command(self) -> list[str]:
        listen = (["--port", "0", "--unixsocket", str(self.socket), "--unixsocketperm", "700"]
                  if self.socket is not None else
                  ["--port", str(self.port), "--bind", "127.0.0.1"])
        save = self.save.split() if self.save else [""]
        args = [self.binary, *listen, "--dir", str(self.data_dir),
                "--appendonly", "yes" if self.aof else "no",
                "--appendfsync", self.appendfsync, "--save", *save,
                "--daemonize", "no", "--logfile", str(self.base_dir / "redis.log"),
                "--protected-mode", "no", *self.extra]
        if self.holder is None:
            return args
        user = [] if os.geteuid() == 0 else ["--user", "--preserve-credentials"]
        return ["nsenter", "-t", str(self.holder.pid), "--mount", *user, "--", *args]

    def _hold_tmpfs(self) -> None:
        """The namespace and its tmpfs, mounted over the data directory: nobody else's."""
        script = ('mount -t tmpfs -o size="$1"m,mode=0700 qc-chaos-disk "$2" && echo mounted '
                  '&& exec sleep 100000')
        # Not root: a user namespace of its own too, in which mounting a tmpfs is allowed.
        as_root = [] if os.geteuid() == 0 else ["--map-root-user"]
        self.holder = subprocess.Popen(
            ["unshare", *as_root, "--mount", "--propagation", "private", "sh", "-c", script,
             "sh", str(self.tmpfs_mb), str(self.data_dir)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_die_with_parent)
        assert self.holder.stdout is not None
        answer = self.holder.stdout.readline().decode(errors="replace").strip()
        if answer != "mounted":
            self.holder.kill()
            self.holder.wait()
            self.holder = None
            raise BrokerUnavailable(f"no tmpfs of the row's own (unshare --mount): {answer}")

    def start(self) -> str:
        """Start (or start again, same port or socket, same data); returns the URL."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.socket is not None:
            self.socket.unlink(missing_ok=True)
        elif not self.port:
            self.port = free_port()
        if self.tmpfs_mb and self.holder is None:
            self._hold_tmpfs()
        self.proc = subprocess.Popen(
            self.command(), cwd=self.base_dir, stdin=subprocess.DEVNULL,
            stdout=(self.base_dir / "stdout.log").open("ab"), stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_die_with_parent)
        reason = self._wait_ready()
        if reason:
            self.stop()
            raise BrokerUnavailable(f"redis-server did not start: {reason}\n"
                                    f"{_tail(self.base_dir / 'redis.log')}\n"
                                    f"{_tail(self.base_dir / 'stdout.log')}")
        return self.url

    def kill(self) -> None:
        """SIGKILL: no shutdown, no last save."""
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        """Shut the server down (and drop its tmpfs, if any)."""
        if self.proc is not None:
            _stop_group(self.proc, timeout_s=20)
            self.proc = None
        if self.holder is not None:
            _stop_group(self.holder, timeout_s=10)
            self.holder = None

    def client(self) -> redis.Redis:
        if self.socket is not None:
            return redis.Redis(unix_socket_path=str(self.socket), socket_timeout=10)
        return redis.Redis(port=self.port, socket_timeout=10)

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return f"exited with status {self.proc.returncode}"
            try:
                with self.client() as client:
                    client.ping()
                    # Loading the AOF answers -LOADING until done: a job read then is not there.
                    if int(client.info("persistence").get("loading", 0)) == 0:
                        return ""
            except redis.RedisError:
                pass
            time.sleep(0.05)
        return f"no answer after {START_TIMEOUT_S:g} s"


def kill_embedded(state_dir: Path) -> int:
    """SIGKILL the embedded broker's server of ``state_dir``; returns its pid."""
    pid = int((state_dir / "redis.pid").read_text().split()[0])
    os.kill(pid, signal.SIGKILL)
    wait_dead(pid)
    return pid


class RestartableRabbitMQ(PrivateRabbitMQ):
    """A private node whose restart keeps its AMQP port (clients reconnect to the same
    URL), node name and data (durable queues, persistent messages)."""

    def kill(self) -> None:
        """SIGKILL the node's process group (no orderly shutdown), then its epmd."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None
        self.stop()

    def restart(self) -> None:
        """Start again after :meth:`stop` or :meth:`kill` (stops it first if it runs)."""
        port = self.port
        self.stop()
        self.port = port
        self.env = self._environment()
        self.env["RABBITMQ_NODE_PORT"] = str(port)
        self._write_files()
        self.epmd = subprocess.Popen(
            ["epmd", "-port", self.env["ERL_EPMD_PORT"], "-address", "127.0.0.1"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=_die_with_parent)
        with open(self.base_dir / "startup.log", "ab") as log:
            self.proc = subprocess.Popen(
                [str(Path("/usr/lib/rabbitmq/bin/rabbitmq-server"))], cwd=self.base_dir,
                env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_die_with_parent)
        reason = self._wait_ready()
        if reason:
            raise BrokerUnavailable(f"RabbitMQ node did not restart: {reason}\n"
                                    f"{_tail(self.base_dir / 'startup.log')}")


def chaos_run(name: str, url: str, seed: int, workdir: Path, *,
              client_url: str | None = None) -> ChaosRun:
    """A :class:`ChaosRun` (tests/chaos/conftest.py) on a broker of the row's own, built as
    the ``chaos`` fixture builds one; stop it with :func:`close_run`. The processes use
    ``url``; the producer and the drain's checks ``client_url`` (default ``url``: another
    path to the same broker, e.g. around a proxy)."""
    prefix = f"n{uuid.uuid4().hex[:8]}"
    ledger_dir = workdir / "ledger"
    ledger_dir.mkdir(parents=True, exist_ok=True)
    env = {LEDGER_ENV: str(ledger_dir), "QC_CHAOS_PREFIX": prefix,
           "QCLUSTER_METRICS_DIR": str(workdir / "metrics")}
    client = Client(client_url or url)
    return ChaosRun(broker=ChaosBroker(name, url), seed=seed, workdir=workdir, prefix=prefix,
                    procs=Procs(workdir, env), client=client,
                    producer=Producer(client, ledger_dir, seed=seed, chunk=20),
                    rng=random.Random(seed))


def close_run(run: ChaosRun) -> None:
    run.stop_all()
    with contextlib.suppress(Exception):
        run.client.close()


class Feeder:
    """A producer thread that keeps enqueueing ``chunk`` jobs at about ``per_s`` jobs a
    second through faults, with a :class:`Client` of its own on ``url`` (a kombu connection
    is not to be shared between threads): an enqueue error is recorded in the ledger and
    the feed goes on (its message kept in ``producer.errors``)."""

    def __init__(self, run: ChaosRun, queue: str, url: str, *, per_s: float = 300.0,
                 chunk: int = 20) -> None:
        self.queue, self.per_s, self.chunk = queue, per_s, chunk
        self.producer = Producer(Client(url), run.ledger_dir, seed=run.seed, tag="f",
                                 chunk=chunk)
        self._on = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="chaos-feeder", daemon=True)

    def start(self) -> Feeder:
        self._on.set()
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 120.0) -> None:
        """Stop and join; a producer stuck in an enqueue call fails the row."""
        self._on.clear()
        self._thread.join(timeout=timeout_s)
        assert not self._thread.is_alive(), "the producer hangs in an enqueue call"
        with contextlib.suppress(Exception):
            self.producer.client.close()

    def halt(self) -> None:
        """Stop without waiting (cleanup after a failed row)."""
        self._on.clear()

    def _loop(self) -> None:
        while self._on.is_set():
            started = time.monotonic()
            self.producer.enqueue(self.queue, self.chunk, raise_errors=False)
            time.sleep(max(0.0, self.chunk / self.per_s - (time.monotonic() - started)))


def completed(run: ChaosRun) -> int:
    return len(run.ledger().completed_ids())


def wait_progress(run: ChaosRun, beyond: int, what: str) -> int:
    """Until more than ``beyond`` jobs completed; returns the count then."""
    seen = [beyond]

    def more() -> bool:
        seen[0] = completed(run)
        return seen[0] > beyond

    wait_until(more, interval_s=0.1, message=what)
    return seen[0]


def backlog(run: ChaosRun, queue: str) -> int:
    """Ready jobs now (0 while the broker does not answer)."""
    try:
        return int(run.client.stats(queue)["ready"])
    except Exception:
        return 0
