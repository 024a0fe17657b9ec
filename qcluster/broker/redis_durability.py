"""How safely a Redis keeps acknowledged jobs, and the parts of the broker that differ on a
Redis Cluster or behind Sentinel: the connect-time durability check, a publish that waits
for replicas (``WAIT``), and reaching each Cluster master on its own.

Functions of :class:`qcluster.broker.redis_broker.RedisBroker`'s state; the queue logic
is the broker's, the same on every Redis.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import redis

from qcluster.broker.base import unreachable
from qcluster.broker.redis_client import CONNECTION_ERRORS, SLOT_MAP_CHANGES, SOCKET_TIMEOUT_S
from qcluster.broker.redis_jobs import decoded
from qcluster.broker.urls import REDIS_HA_SCHEMES
from qcluster.errors import BrokerError, BrokerUnavailable, ConfigError, ReplicationUnconfirmed

if TYPE_CHECKING:
    from qcluster.broker.redis_broker import RedisBroker

# The broker's logger: slots filter the durability notes by its name.
logger = logging.getLogger("qcluster.broker.redis_broker")

#: Eviction policies that may delete keys, hence jobs: refused at connect.
EVICTING_POLICIES = frozenset({
    "allkeys-lru", "allkeys-lfu", "allkeys-random",
    "volatile-lru", "volatile-lfu", "volatile-random", "volatile-ttl",
})
_warned_durability: set[str] = set()


def durability(broker: RedisBroker) -> list[str]:
    """See RedisBroker.durability."""
    broker._unanswered, broker._silent = [], []
    try:
        with broker._errors():
            config = _weakest(server_configs(broker, ("appendonly", "save", "maxmemory-policy")))
    except BrokerUnavailable:
        raise
    except BrokerError:
        return [f"durability not checked: CONFIG GET is not allowed on {broker.safe_url}"]
    policy = config.get("maxmemory-policy", "noeviction")
    if policy in EVICTING_POLICIES:
        raise ConfigError(
            f"Redis at {broker.safe_url} has maxmemory-policy {policy}: it evicts keys, "
            "i.e. deletes jobs when memory runs out. Set maxmemory-policy noeviction."
        )
    notes = _persistence_notes(broker.safe_url, config)
    if broker.safe_url.startswith(REDIS_HA_SCHEMES) and not broker.replicas:
        notes.append(
            f"Redis at {broker.safe_url} publishes without waiting for a replica "
            "(replicas=0): a failover can lose the jobs published just before it."
        )
    if broker.replicas:
        try:
            with broker._errors():
                notes += _short_of_replicas(broker)
        except BrokerUnavailable:
            raise
        except BrokerError:
            pass  # INFO not allowed (managed Redis): the publish's error will say it
    notes += [f"Redis at {broker.safe_url}: master {where} does not answer: its durability "
              "is not checked (its shard's queues fail until a replica takes over)"
              for where in broker._unanswered]
    return notes


def _persistence_notes(safe_url: str, config: dict[str, str]) -> list[str]:
    if config.get("appendonly", "no") == "yes":
        return []
    if config.get("save", "").strip():
        return [f"Redis at {safe_url} persists by snapshots only (appendonly no): "
                "a crash loses the jobs of the last minutes. Set appendonly yes."]
    return [f"Redis at {safe_url} has no persistence (appendonly no, no save): "
            "a restart loses every job. Set appendonly yes."]


def masters(broker: RedisBroker) -> list[redis.Redis]:
    """Our server, or every master of a Cluster that answers (each its own client).

    A Cluster master that does not answer is left out (named in ``_unanswered``, and in
    ``_silent`` when it timed out): its shard's queues fail on their own until its replica
    is elected, while the other shards serve theirs. Requiring every master made one dead
    node stop every queue of a process started while it was down (the check runs before
    its first call). One named there is not asked again within the same check (a frozen
    master cost one socket timeout per question)."""
    if not broker.cluster:
        return [broker.client]
    answering = []
    cluster = cast(Any, broker.client)
    for node in cluster.get_primaries():
        where = f"{node.host}:{node.port}"
        if where in broker._unanswered:
            continue
        server = cluster.get_redis_connection(node)
        try:
            server.ping()
        except CONNECTION_ERRORS as exc:
            broker._unanswered.append(where)
            if isinstance(exc, redis.TimeoutError):
                broker._silent.append(where)
            continue
        answering.append(server)
    if not answering:
        raise redis.ConnectionError(f"no master answers ({', '.join(broker._unanswered)})")
    return answering


def _short_of_replicas(broker: RedisBroker) -> list[str]:
    """A note per master with fewer connected replicas than a publish waits for."""
    notes = []
    for server in masters(broker):
        info = server.info("replication")
        connected = int(info.get("connected_slaves", 0))
        if connected < broker.replicas:
            options = server.get_connection_kwargs()
            where = (f"{options.get('host')}:{options.get('port')}" if broker.cluster
                     else "the master")
            notes.append(
                f"Redis at {broker.safe_url}: {where} has {connected} replica(s) connected, "
                f"fewer than replicas={broker.replicas}: publishes fail until one is.")
    return notes


def server_configs(broker: RedisBroker, names: Sequence[str]) -> list[dict[str, str]]:
    """``CONFIG GET`` of each name on our server, or on every master of a Cluster."""
    configs = []
    for server in masters(broker):
        config: dict[str, str] = {}
        for name in names:
            reply = server.config_get(name)
            config.update({decoded(k): decoded(v) for k, v in reply.items()})
        configs.append(config)
    return configs


def _weakest(configs: list[dict[str, str]]) -> dict[str, str]:
    """One configuration for several servers (a Cluster's masters): the one that keeps
    jobs least safely decides (an evicting policy, then no append-only file)."""
    evicting = [c for c in configs if c.get("maxmemory-policy") in EVICTING_POLICIES]
    no_aof = [c for c in configs if c.get("appendonly", "no") != "yes"]
    return (evicting or no_aof or configs or [{}])[0]


def warn_once(notes: list[str]) -> None:
    """Log each durability note once per process."""
    for note in notes:
        if note not in _warned_durability:
            _warned_durability.add(note)
            logger.warning("%s", note)


def publish_replicated(broker: RedisBroker, name: str, keys: list[str], args: list[Any]) -> Any:
    """The publishing script ``name``, then ``WAIT`` on the same connection (WAIT
    counts the replicas that have this connection's writes): the jobs survive a
    failover once this returns. A pipeline sends both; redis-py replays the pair on a
    new connection after a connection error (a replayed publish stores nothing more:
    an id the queue holds is left as it is)."""
    script = broker._scripts[name]
    with broker._errors():
        for attempt in range(3):
            server = server_for(broker, keys[0])
            pipe = server.pipeline(transaction=False)
            pipe.evalsha(script.sha, len(keys), *keys, *args)
            pipe.execute_command("WAIT", broker.replicas, broker.replica_timeout_ms)
            try:
                reply, acked = pipe.execute()
                break
            except redis.exceptions.NoScriptError:  # a new master: load it there
                script.sha = server.script_load(script.script)
            except SLOT_MAP_CHANGES as exc:
                if not broker.cluster:
                    raise
                broker._stale_slot_map = True  # a master died or moved: look it up again
                # A short-lived caller hears of a silent master after one timeout, not three.
                if attempt == 2 or (broker.short_lived and isinstance(exc, redis.TimeoutError)):
                    raise
                time.sleep(0.5 * (attempt + 1))
        else:
            raise BrokerError(f"Redis at {broker.safe_url}: publish script not loaded")
    if int(acked) < broker.replicas:
        raise ReplicationUnconfirmed(
            f"Redis at {broker.safe_url}: the jobs reached the master but only {acked} of "
            f"{broker.replicas} replica(s) within {broker.replica_timeout_ms} ms, so a "
            "failover could lose them; publish them again (an id the queue still holds "
            "is kept as it is, never stored twice)")
    return reply


def refuse_silent_master(broker: RedisBroker, key: str) -> None:
    """A short-lived caller's call right after the durability check: when the master
    holding ``key`` just let the check's PING time out (frozen, or its link went silent),
    it is not waited for a second socket timeout."""
    if not broker.cluster or not broker._silent:
        return
    node = cast(Any, broker.client).get_node_from_key(key)
    where = f"{node.host}:{node.port}"
    if where in broker._silent:
        raise BrokerUnavailable(unreachable(
            "Redis", broker.safe_url,
            f"master {where}, which holds the queue, did not answer in {SOCKET_TIMEOUT_S:g} s"))


def server_for(broker: RedisBroker, key: str) -> redis.Redis:
    """The client whose connection reaches the master holding ``key``: ours, or on a
    Cluster that master's own (WAIT has no key for the cluster client to route by)."""
    if not broker.cluster:
        return broker.client
    cluster = cast(Any, broker.client)
    if broker._stale_slot_map:
        cluster.nodes_manager.initialize()
        broker._stale_slot_map = False
    return cast(redis.Redis, cluster.get_redis_connection(cluster.get_node_from_key(key)))
