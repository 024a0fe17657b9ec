"""Redis past one server: a master found through Sentinel, or a Redis Cluster.

URLs (the ``redis+sentinel://`` form other Redis tools use for Sentinel):

- ``redis+sentinel://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB][?OPTIONS]``: the
  hosts are Sentinels (port 26379 when left out); the password is the master's.
- ``redis+cluster://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...][/0][?OPTIONS]``: any nodes of
  the cluster (port 6379 when left out); the client discovers the rest.

OPTIONS: ``replicas=N`` (a publish returns once N replicas hold the jobs, by ``WAIT``; default
1, ``0`` turns it off), ``replica_timeout_ms=MS`` (how long a publish waits for them, default
2000), ``sentinel_password=...`` (Sentinel only, when the Sentinels require one).

This module only parses URLs and builds the redis-py client; the queue logic is
:mod:`qcluster.broker.redis_broker`'s, the same on every Redis.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import parse_qsl, unquote

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError, Sentinel

from qcluster.broker.redis_broker import SOCKET_TIMEOUT_S
from qcluster.errors import ConfigError

SENTINEL_SCHEME = "redis+sentinel://"
CLUSTER_SCHEME = "redis+cluster://"
HA_SCHEMES = (SENTINEL_SCHEME, CLUSTER_SCHEME)
SENTINEL_PORT = 26379
CLUSTER_PORT = 6379
#: A publish waits for this many replicas by default: without it, a failover can drop
#: jobs the master acknowledged but had not yet sent to a replica.
DEFAULT_REPLICAS = 1
DEFAULT_REPLICA_TIMEOUT_MS = 2000
#: WAIT must answer before the client's socket timeout, with room for the round trip.
MAX_REPLICA_TIMEOUT_MS = int(SOCKET_TIMEOUT_S * 1000) - 500
_OPTIONS = ("replicas", "replica_timeout_ms", "sentinel_password")


@dataclass(frozen=True)
class HaUrl:
    """A parsed ``redis+sentinel://`` or ``redis+cluster://`` URL."""

    kind: str
    """``"sentinel"`` or ``"cluster"``."""
    hosts: tuple[tuple[str, int], ...]
    service: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None
    replicas: int = DEFAULT_REPLICAS
    replica_timeout_ms: int = DEFAULT_REPLICA_TIMEOUT_MS

    def safe(self) -> str:
        """The URL without its passwords (for logs and errors)."""
        user = f"{self.username or ''}:***@" if self.password else ""
        hosts = ",".join(f"{_host_text(host)}:{port}" for host, port in self.hosts)
        path = f"/{self.service}/{self.db}" if self.kind == "sentinel" else ""
        return f"redis+{self.kind}://{user}{hosts}{path}"


def is_ha_url(url: str) -> bool:
    return url.startswith(HA_SCHEMES)


def parse_ha_url(url: str) -> HaUrl:
    """Parse a Sentinel or Cluster URL.

    Raises:
        ConfigError: one line saying what is wrong (never echoing a password).
    """
    kind = "sentinel" if url.startswith(SENTINEL_SCHEME) else "cluster"
    rest = url.split("://", 1)[1]
    netloc, _, tail = rest.partition("/")
    path, _, query = tail.partition("?")
    if "?" in netloc:  # redis+cluster://host:port?replicas=0 has no path
        netloc, _, query = netloc.partition("?")
    userinfo, has_user, hostlist = netloc.rpartition("@")
    username = password = None
    if has_user:
        user, _, secret = userinfo.partition(":")
        username, password = unquote(user) or None, unquote(secret) or None
    default_port = SENTINEL_PORT if kind == "sentinel" else CLUSTER_PORT
    hosts = tuple(_host_port(item, default_port, kind) for item in hostlist.split(",") if item)
    if not hosts:
        raise ConfigError(f"redis+{kind}:// URL names no host: give HOST:PORT[,HOST:PORT...]")
    options = _options(query, kind)
    segments = [unquote(part) for part in path.split("/") if part]
    if kind == "sentinel":
        if not segments:
            raise ConfigError("redis+sentinel:// URL names no service: "
                              "redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE[/DB]")
        service, db = segments[0], _db(segments[1:], kind)
    else:
        service, db = "", _db(segments, kind)
        if db:
            raise ConfigError("redis+cluster:// has only database 0 (a cluster has no others)")
    return HaUrl(kind=kind, hosts=hosts, service=service, db=db, username=username,
                 password=password, **options)


def connect(parsed: HaUrl, client_options: dict[str, Any]) -> redis.Redis | LazyCluster:
    """The redis-py client for ``parsed``; ``client_options`` are the timeouts, keepalive
    and retry a single Redis gets too (see RedisBroker.from_url)."""
    credentials: dict[str, Any] = {"username": parsed.username, "password": parsed.password}
    if parsed.kind == "sentinel":
        sentinel_options = {key: value for key, value in client_options.items()
                            if key.startswith("socket_")}
        sentinel_options["password"] = parsed.sentinel_password
        # A Sentinel that does not answer is skipped for the next one, not retried: the
        # master connection's own retries already ask them all again.
        sentinel_options["retry"] = Retry(NoBackoff(), 0)
        sentinel = _Sentinels(list(parsed.hosts), sentinel_kwargs=sentinel_options)
        # The pool asks the Sentinels for the master at each new connection, and drops
        # the connections to a master that was demoted (READONLY) or died: the retry that
        # follows connects to the new one.
        return sentinel.master_for(parsed.service, db=parsed.db, **credentials,
                                   **client_options)
    options = dict(client_options)
    options.pop("retry_on_error", None)  # RedisCluster retries by its own rules
    return LazyCluster(lambda: RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in parsed.hosts],
        require_full_coverage=True, **credentials, **options,
    ))


class _Sentinels(Sentinel):
    """redis-py's Sentinel, with a one-line error when no Sentinel names a master (its
    own message carries the repr of every Sentinel client: hundreds of characters)."""

    def discover_master(self, service_name: str) -> tuple[str, int]:
        try:
            address: tuple[str, int] = super().discover_master(service_name)
        except MasterNotFoundError as exc:
            asked = ",".join(f"{_host_text(str(client.get_connection_kwargs()['host']))}:"
                             f"{client.get_connection_kwargs()['port']}"
                             for client in self.sentinels)
            raise MasterNotFoundError(
                f"no Sentinel of {asked} named a master for {service_name!r} (each was "
                "down, did not answer, or does not monitor it)") from exc
        return address


class LazyCluster:
    """A RedisCluster made at its first use. Its constructor connects (it reads the slot
    map), so a process started while the cluster is down would die of it; this way its
    calls raise ``redis.ConnectionError`` (BrokerUnavailable for the broker) until a node
    answers, as a single Redis's would."""

    def __init__(self, make: Callable[[], RedisCluster]) -> None:
        self._make = make
        self._client: RedisCluster | None = None

    def register_script(self, script: str) -> NodeScript:
        # Hashed here, loaded on the server at first call; it calls us as the cluster client.
        return NodeScript(self, script)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._connected(), name)

    def _connected(self) -> RedisCluster:
        if self._client is None:
            try:
                self._client = self._make()
            except RedisClusterException as exc:  # no node answered
                raise redis.ConnectionError(str(exc)) from exc
        return self._client


class NodeScript:
    """A script run on the node that holds its keys: EVALSHA there, and on NOSCRIPT, EVAL
    there (which also caches it on that node). redis-py's Script loads a missing script
    with SCRIPT LOAD on every master, which fails while any one of them is down: one dead
    shard then stopped every script of a process, on the live shards too. It offers what
    the broker uses of redis-py's ``Script`` (``sha``, ``script``, the call) on public
    commands only: nothing of redis-py's internals."""

    def __init__(self, registered_client: Any, script: str) -> None:
        self.registered_client = registered_client
        self.script = script
        self.sha = hashlib.sha1(script.encode()).hexdigest()  # as Redis names it

    def __call__(self, keys: Any = None, args: Any = None, client: Any = None) -> Any:
        keys, args = list(keys or ()), list(args or ())
        target = client if client is not None else self.registered_client
        try:
            return target.evalsha(self.sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            return target.eval(cast(str, self.script), len(keys), *keys, *args)


def cluster_retry(retries: int) -> Retry:
    """How RedisCluster retries a command that met a dead or moved master (it reads the
    slot map again between tries); after that BrokerUnavailable, and a slot pauses and
    tries again until the shard's replica is elected."""
    return Retry(ExponentialBackoff(cap=2.0, base=0.1), retries,
                 supported_errors=(redis.ConnectionError, redis.TimeoutError))


def _host_port(item: str, default_port: int, kind: str) -> tuple[str, int]:
    item = item.strip()
    if item.startswith("["):  # [::1]:26379
        host, _, port_text = item[1:].partition("]")
        port_text = port_text.removeprefix(":")
    else:
        host, _, port_text = item.partition(":")
    if not host:
        raise ConfigError(f"redis+{kind}:// URL has an empty host in its host list")
    if not port_text:
        return host, default_port
    if not (port_text.isascii() and port_text.isdigit()) or not 0 < int(port_text) < 65536:
        raise ConfigError(f"redis+{kind}:// URL has a bad port {port_text[:10]!r} "
                          f"for host {host[:60]!r}")
    return host, int(port_text)


def _db(segments: list[str], kind: str) -> int:
    if not segments:
        return 0
    text = segments[0]
    if len(segments) > 1 or not (text.isascii() and text.isdigit()):
        raise ConfigError(f"redis+{kind}:// URL path: the database must be a number, "
                          f"got {'/'.join(segments)[:40]!r}")
    return int(text)


def _options(query: str, kind: str) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key not in _OPTIONS or (key == "sentinel_password" and kind != "sentinel"):
            known = ", ".join(o for o in _OPTIONS if kind == "sentinel" or "sentinel" not in o)
            raise ConfigError(f"redis+{kind}:// URL option {key[:40]!r} is not known "
                              f"(known: {known})")
        if key == "sentinel_password":
            options[key] = value or None
            continue
        if not (value.isascii() and value.isdigit()):
            raise ConfigError(f"redis+{kind}:// URL option {key}={value[:20]!r}: "
                              "a whole number is needed")
        options[key] = int(value)
        if key == "replica_timeout_ms" and not 1 <= options[key] <= MAX_REPLICA_TIMEOUT_MS:
            # 0 is "wait forever" to Redis; above the socket timeout the client gives up first.
            raise ConfigError(f"redis+{kind}:// URL option replica_timeout_ms={value}: 1 to "
                              f"{MAX_REPLICA_TIMEOUT_MS} (a publish's socket times out at "
                              f"{SOCKET_TIMEOUT_S:g} s)")
    return options


def _host_text(host: str) -> str:
    return f"[{host}]" if ":" in host else host


__all__ = [
    "CLUSTER_SCHEME", "HA_SCHEMES", "SENTINEL_SCHEME", "HaUrl", "LazyCluster", "cluster_retry",
    "connect", "is_ha_url", "parse_ha_url",
]
