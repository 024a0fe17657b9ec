"""Redis past one server: a master found through Sentinel, or a Redis Cluster.

URLs: ``redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE[/DB][?OPTIONS]`` and
``redis+cluster://HOST:PORT[,HOST:PORT...][?OPTIONS]``, parsed by
:mod:`qcluster.broker.urls` (which describes their forms and options).

This module only builds the redis-py client; the queue logic is
:mod:`qcluster.broker.redis_broker`'s, the same on every Redis (its Cluster and replica
parts: :mod:`qcluster.broker.redis_durability`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, cast

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError, Sentinel

from qcluster.broker.redis_client import cluster_backoff
from qcluster.broker.urls import BrokerUrl, host_text


def connect(parsed: BrokerUrl, client_options: dict[str, Any], *,
            short_lived: bool = False) -> redis.Redis | LazyCluster:
    """The redis-py client for ``parsed``; ``client_options`` are the timeouts, keepalive
    and retry a single Redis gets too (see RedisBroker.from_url). ``short_lived``: a
    Cluster command that timed out is not retried (:class:`ShortLivedCluster`)."""
    credentials: dict[str, Any] = {"username": parsed.username, "password": parsed.password}
    if parsed.kind == "redis-sentinel":
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
    cluster = ShortLivedCluster if short_lived else RedisCluster
    return LazyCluster(lambda: cluster(
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
            asked = ",".join(f"{host_text(str(client.get_connection_kwargs()['host']))}:"
                             f"{client.get_connection_kwargs()['port']}"
                             for client in self.sentinels)
            raise MasterNotFoundError(
                f"no Sentinel of {asked} named a master for {service_name!r} (each was "
                "down, did not answer, or does not monitor it)") from exc
        return address


class ShortLivedCluster(RedisCluster):
    """RedisCluster for a short-lived caller (give_up_s): a command that timed out (a
    frozen master, a link that went silent) is not tried again, so the caller hears after
    one socket timeout rather than one per retry (four: 20 s and more). A refused or
    dropped connection (a dead master) is still retried, within give_up_s. RedisCluster
    retries the error types of this class attribute (guarded in
    tests/contract/test_dependency_internals.py); long-lived processes keep them all and
    ride out a failover."""

    ERRORS_ALLOW_RETRY = tuple(  # type: ignore[assignment]
        error for error in RedisCluster.ERRORS_ALLOW_RETRY
        if not issubclass(error, redis.TimeoutError))


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


def cluster_retry(retries: int, *, timeouts: bool = True) -> Retry:
    """How RedisCluster retries a command that met a dead or moved master (it reads the
    slot map again between tries); after that BrokerUnavailable, and a slot pauses and
    tries again until the shard's replica is elected. ``timeouts`` False: a short-lived
    caller's (with :class:`ShortLivedCluster`), which does not retry a timeout."""
    errors = (redis.ConnectionError, redis.TimeoutError) if timeouts else (redis.ConnectionError,)
    return Retry(cluster_backoff(), retries, supported_errors=errors)


__all__ = [
    "LazyCluster", "ShortLivedCluster", "cluster_retry", "connect",
]
