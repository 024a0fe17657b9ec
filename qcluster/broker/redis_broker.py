"""The Redis backend: the fast path.

Each queue lives in a few keys sharing a hash tag (``qc:{NAME}:...``); activation time
and lock expiry are both scores in time, so delays, retries and expired locks need
no extra process. Taking a batch (with its lock), settling a batch, publishing and
counting are each one Lua script, i.e. one atomic round trip, timed by the Redis
server's clock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib import resources
from typing import Any, cast

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from qcluster.broker import redis_jobs
from qcluster.broker.base import (
    Broker,
    DeadJob,
    DeadRetention,
    QueueStats,
    Settlement,
    mask_url,
)
from qcluster.broker.redis_jobs import decoded, int_or_zero
from qcluster.errors import (
    BrokerError,
    BrokerUnavailable,
    ConfigError,
    ReplicationUnconfirmed,
)
from qcluster.job import JSON_CONTENT_TYPE, MAX_DELAY_S, Delivery
from qcluster.jobs import JobInfo, JobPage
from qcluster.names import check_queue_name
from qcluster.policy import DEFAULT_DEAD_MAX_AGE, DEFAULT_DEAD_MAX_COUNT, FINISHED_MAX_COUNT

logger = logging.getLogger(__name__)

KEY_PREFIX = "qc"
QUEUES_KEY = f"{KEY_PREFIX}:queues"
#: Operator controls (the manager's pause and drain): one small field per control, named
#: ``KIND:NAME``, in one hash, so that reading them all is one atomic round trip and they
#: sit in one hash slot of a Redis Cluster.
CONTROLS_KEY = f"{KEY_PREFIX}:{{controls}}"
#: Lua's unpack() is limited to a few thousand values; publish in chunks below it.
PUBLISH_CHUNK = 500
#: Longest single wait on the wake list, so SIGTERM and delayed jobs are noticed.
MAX_BLOCK_S = 1.0
#: A reply slower than this ends the call with BrokerUnavailable (a silent server or a
#: dead link must not hang producers and slots); above MAX_BLOCK_S, the longest wait.
SOCKET_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 5.0
#: Seconds idle after which a pooled connection is pinged before its next use.
HEALTH_CHECK_INTERVAL_S = 10
#: Eviction policies that may delete keys, hence jobs: refused at connect.
EVICTING_POLICIES = frozenset({
    "allkeys-lru", "allkeys-lfu", "allkeys-random",
    "volatile-lru", "volatile-lfu", "volatile-random", "volatile-ttl",
})
#: RedisClusterException: no node of a Cluster answered; CLUSTERDOWN: a shard has no
#: master (yet): both pass once the cluster is back, like a connection error.
_CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError,
                      redis.exceptions.RedisClusterException, redis.exceptions.ClusterDownError)
#: Replies and errors of a Cluster master that died, is failing over or gave its slots away.
_SLOT_MAP_CHANGES = (
    redis.ConnectionError, redis.TimeoutError, redis.exceptions.MovedError,
    redis.exceptions.AskError, redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
)
_warned_durability: set[str] = set()



def _keys(queue: str) -> dict[str, str]:
    base = f"{KEY_PREFIX}:{{{queue}}}"
    return {
        name: f"{base}:{name}"
        for name in ("ready", "locked", "jobs", "attempts", "dead", "reasons", "wake", "queues",
                     "ticks", "errors", "finished")
    }


def _registry_key(queue: str) -> str:
    """On a Redis Cluster, the queue's own registry (a set holding its name) in its hash
    slot: the publish script may only touch keys of one slot, so the one ``qc:queues`` set
    of a single Redis is out of its reach (``queues()`` reads these from every master)."""
    return _keys(queue)["queues"]


def _load_script(name: str) -> str:
    return resources.files("qcluster.broker").joinpath("lua", f"{name}.lua").read_text()


class RedisBroker(Broker):
    """Queue server on Redis >= 5 (redis://, rediss://, redis+socket://, unix://)."""

    #: A lock is a token (the take's lock expiry) any process can present: a master gives
    #: the jobs of a slot that died back at once (base.Broker.settles_for_others).
    settles_for_others = True

    def __init__(
        self, client: redis.Redis, *, safe_url: str,
        dead_max_count: int = DEFAULT_DEAD_MAX_COUNT,
        dead_max_age_s: float = DEFAULT_DEAD_MAX_AGE,
        replicas: int = 0, replica_timeout_ms: int = 0, cluster: bool = False,
    ) -> None:
        """``dead_max_count``/``dead_max_age_s``: dead-letter retention for a settle
        whose ``retention`` is None (a slot passes its queue's policy). ``replicas``: a
        publish returns once that many replicas hold its jobs (``WAIT``, at most
        ``replica_timeout_ms``), else raises BrokerUnavailable. ``cluster``: ``client`` is
        a RedisCluster (queue registries per queue, see _registry_key)."""
        self.client = client
        self.safe_url = safe_url
        self.replicas = replicas
        self.replica_timeout_ms = replica_timeout_ms
        self.cluster = cluster
        self._unanswered: list[str] = []
        """Cluster masters that did not answer the last durability check."""
        self._stale_slot_map = False
        """A Cluster master did not answer or moved: refresh the slot map before the next
        replicated publish (that path talks to the master directly, see _server_for)."""
        self._retention = DeadRetention(dead_max_count, dead_max_age_s)
        self._scripts = {
            name: client.register_script(_load_script(name))
            for name in ("take", "settle", "publish", "stats", "requeue_dead", "purge", "job",
                         "dead_ids")
        }
        self._scripts["settle_take"] = client.register_script(_settle_take_script())
        self._scripts["tick"] = client.register_script(_tick_script())
        self._durability_pending = False
        """check_durability could not reach the server: check before the next call."""

    @classmethod
    def from_url(cls, url: str, *, retries: int = 5) -> RedisBroker:
        """Connect lazily; failed connections are retried with backoff.

        A server that stops answering is not retried: after SOCKET_TIMEOUT_S the call
        raises BrokerUnavailable (the slot loop pauses and tries again, reconnecting),
        instead of hanging forever on a dead link. TCP keepalive notices a dead peer on
        idle connections.
        """
        if url.startswith(("redis+sentinel://", "redis+cluster://")):
            return cls._from_ha_url(url, retries=retries)
        if url.startswith("redis+socket://"):
            url = "unix://" + url.removeprefix("redis+socket://")
        options = _client_options(retries)
        if url.startswith("unix://"):
            del options["socket_keepalive"]
        client = redis.Redis.from_url(url, **options)
        return cls(client, safe_url=mask_url(url))

    @classmethod
    def _from_ha_url(cls, url: str, *, retries: int) -> RedisBroker:
        """A master through Sentinel or a Redis Cluster (see redis_ha), with the same
        timeouts and keepalive as one Redis."""
        from qcluster.broker import redis_ha

        parsed = redis_ha.parse_ha_url(url)
        options = _client_options(retries)
        if parsed.kind == "cluster":
            options["retry"] = redis_ha.cluster_retry(retries)
        client = redis_ha.connect(parsed, options)
        # RedisCluster offers the commands used here under the same names (routed by key).
        return cls(cast(redis.Redis, client), safe_url=parsed.safe(),
                   replicas=parsed.replicas, replica_timeout_ms=parsed.replica_timeout_ms,
                   cluster=parsed.kind == "cluster")

    def durability(self) -> list[str]:
        """Notes on how safely this Redis keeps acknowledged jobs (empty: nothing to say).

        Reads ``CONFIG GET appendonly/save/maxmemory-policy``; a server that disables
        CONFIG (managed Redis often does) gets a note saying it could not be checked.
        Raises ConfigError for an evicting ``maxmemory-policy``: it deletes jobs.
        """
        try:
            with self._errors():
                config = _weakest(self._server_configs(("appendonly", "save", "maxmemory-policy")))
        except BrokerUnavailable:
            raise
        except BrokerError:
            return [f"durability not checked: CONFIG GET is not allowed on {self.safe_url}"]
        policy = config.get("maxmemory-policy", "noeviction")
        if policy in EVICTING_POLICIES:
            raise ConfigError(
                f"Redis at {self.safe_url} has maxmemory-policy {policy}: it evicts keys, "
                "i.e. deletes jobs when memory runs out. Set maxmemory-policy noeviction."
            )
        notes = []
        if config.get("appendonly", "no") != "yes":
            if config.get("save", "").strip():
                notes.append(
                    f"Redis at {self.safe_url} persists by snapshots only (appendonly no): "
                    "a crash loses the jobs of the last minutes. Set appendonly yes."
                )
            else:
                notes.append(
                    f"Redis at {self.safe_url} has no persistence (appendonly no, no save): "
                    "a restart loses every job. Set appendonly yes."
                )
        if self.safe_url.startswith(("redis+sentinel:", "redis+cluster:")) and not self.replicas:
            notes.append(
                f"Redis at {self.safe_url} publishes without waiting for a replica "
                "(replicas=0): a failover can lose the jobs published just before it."
            )
        if self.replicas:
            try:
                with self._errors():
                    notes += self._short_of_replicas()
            except BrokerUnavailable:
                raise
            except BrokerError:
                pass  # INFO not allowed (managed Redis): the publish's error will say it
        notes += [f"Redis at {self.safe_url}: master {where} does not answer: its durability "
                  "is not checked (its shard's queues fail until a replica takes over)"
                  for where in self._unanswered]
        return notes

    def _masters(self) -> list[redis.Redis]:
        """Our server, or every master of a Cluster that answers (each its own client).

        A Cluster master that does not answer is left out (named in ``_unanswered``): its
        shard's queues fail on their own until its replica is elected, while the other
        shards serve theirs. Requiring every master made one dead node stop every queue of
        a process started while it was down (the check runs before its first call)."""
        if not self.cluster:
            return [self.client]
        answering, self._unanswered = [], []
        cluster = cast(Any, self.client)
        for node in cluster.get_primaries():
            server = cluster.get_redis_connection(node)
            try:
                server.ping()
            except _CONNECTION_ERRORS:
                self._unanswered.append(f"{node.host}:{node.port}")
                continue
            answering.append(server)
        if not answering:
            raise redis.ConnectionError(f"no master answers ({', '.join(self._unanswered)})")
        return answering

    def _short_of_replicas(self) -> list[str]:
        """A note per master with fewer connected replicas than a publish waits for."""
        notes = []
        for server in self._masters():
            info = server.info("replication")
            connected = int(info.get("connected_slaves", 0))
            if connected < self.replicas:
                options = server.get_connection_kwargs()
                where = (f"{options.get('host')}:{options.get('port')}" if self.cluster
                         else "the master")
                notes.append(
                    f"Redis at {self.safe_url}: {where} has {connected} replica(s) connected, "
                    f"fewer than replicas={self.replicas}: publishes fail until one is.")
        return notes

    def _server_configs(self, names: Sequence[str]) -> list[dict[str, str]]:
        """``CONFIG GET`` of each name on our server, or on every master of a Cluster."""
        configs = []
        for server in self._masters():
            config: dict[str, str] = {}
            for name in names:
                reply = server.config_get(name)
                config.update({decoded(k): decoded(v) for k, v in reply.items()})
            configs.append(config)
        return configs

    def check_durability(self) -> None:
        """At connect: refuse an evicting server, warn once per process about the rest.

        A server that does not answer yet is checked before the first call that reaches
        it (see _run), and before every call while it evicts (so that setting
        ``maxmemory-policy noeviction`` lets the process go on without a restart)."""
        try:
            notes = self.durability()
        except BrokerUnavailable:
            self._durability_pending = True  # said again, clearly, by the first real call
            return
        self._durability_pending = False
        _warn_once(notes)

    @contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except _CONNECTION_ERRORS as exc:
            raise BrokerUnavailable(f"Redis at {self.safe_url} unreachable: {exc}") from exc
        except redis.RedisError as exc:
            raise BrokerError(f"Redis at {self.safe_url}: {exc}") from exc

    def _run(self, script: str, keys: list[str], args: list[Any]) -> Any:
        if self._durability_pending:
            self._check_durability_late()
        with self._errors():
            return self._scripts[script](keys=keys, args=args)

    def _check_durability_late(self) -> None:
        """The connect-time check for a server that was down at connect: an evicting one
        is refused (ConfigError, again at every call until it stops evicting) before
        anything is taken or stored; a server still down raises BrokerUnavailable, as
        the call itself would have."""
        notes = self.durability()
        self._durability_pending = False
        _warn_once(notes)

    # --- producing ------------------------------------------------------------

    def publish_many(
        self, queue: str, messages: Sequence[tuple[str, bytes]], *, delay_s: float = 0.0
    ) -> list[str]:
        """Stores the messages whose ids the queue does not hold (publish.lua); returns
        their ids. An id it holds (ready, delayed, locked or dead) is left as it is."""
        k = _keys(check_queue_name(queue))
        keys = [k["ready"], k["jobs"], self._registry(queue), k["wake"]]
        delay_ms = _delay_ms(delay_s)
        stored: list[str] = []
        for start in range(0, len(messages), PUBLISH_CHUNK):
            args: list[Any] = [delay_ms, queue]
            for job_id, body in messages[start : start + PUBLISH_CHUNK]:
                args += (job_id, body)
            reply = self._publishing("publish", keys, args)
            stored += (decoded(job_id) for job_id in reply)
        return list(dict.fromkeys(stored))

    def _registry(self, queue: str) -> str:
        return _registry_key(queue) if self.cluster else QUEUES_KEY

    def _publishing(self, script: str, keys: list[str], args: list[Any]) -> Any:
        """A script that stores jobs, followed by ``WAIT`` when publishes wait for
        replicas (see _publish_replicated); its reply."""
        if self.replicas:
            return self._publish_replicated(script, keys, args)
        return self._run(script, keys, args)

    def _publish_replicated(self, name: str, keys: list[str], args: list[Any]) -> Any:
        """The publishing script ``name``, then ``WAIT`` on the same connection (WAIT
        counts the replicas that have this connection's writes): the jobs survive a
        failover once this returns. A pipeline sends both; redis-py replays the pair on a
        new connection after a connection error (a replayed publish stores nothing more:
        an id the queue holds is left as it is)."""
        if self._durability_pending:
            self._check_durability_late()
        script = self._scripts[name]
        with self._errors():
            for attempt in range(3):
                server = self._server_for(keys[0])
                pipe = server.pipeline(transaction=False)
                pipe.evalsha(script.sha, len(keys), *keys, *args)
                pipe.execute_command("WAIT", self.replicas, self.replica_timeout_ms)
                try:
                    reply, acked = pipe.execute()
                    break
                except redis.exceptions.NoScriptError:  # a new master: load it there
                    script.sha = server.script_load(script.script)
                except _SLOT_MAP_CHANGES:
                    if not self.cluster:
                        raise
                    self._stale_slot_map = True  # a master died or moved: look it up again
                    if attempt == 2:
                        raise
                    time.sleep(0.5 * (attempt + 1))
            else:
                raise BrokerError(f"Redis at {self.safe_url}: publish script not loaded")
        if int(acked) < self.replicas:
            raise ReplicationUnconfirmed(
                f"Redis at {self.safe_url}: the jobs reached the master but only {acked} of "
                f"{self.replicas} replica(s) within {self.replica_timeout_ms} ms, so a "
                "failover could lose them; publish them again (an id the queue still holds "
                "is kept as it is, never stored twice)")
        return reply

    def _server_for(self, key: str) -> redis.Redis:
        """The client whose connection reaches the master holding ``key``: ours, or on a
        Cluster that master's own (WAIT has no key for the cluster client to route by)."""
        if not self.cluster:
            return self.client
        cluster = cast(Any, self.client)
        if self._stale_slot_map:
            cluster.nodes_manager.initialize()
            self._stale_slot_map = False
        return cast(redis.Redis, cluster.get_redis_connection(cluster.get_node_from_key(key)))

    # --- consuming ------------------------------------------------------------

    def take(
        self, queue: str, *, max_jobs: int, lock_timeout_s: float, wait_s: float = 0.0
    ) -> list[Delivery]:
        k = _keys(check_queue_name(queue))
        keys = [k["ready"], k["locked"], k["jobs"], k["attempts"]]
        args = [max_jobs, max(1, round(lock_timeout_s * 1000))]
        deadline = time.monotonic() + wait_s
        while True:
            reply = self._run("take", keys, args)
            if len(reply) > 2:
                return _deliveries(reply)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return []
            self._wait_for_wake(k["wake"], remaining, reply)

    def _wait_for_wake(self, wake_key: str, remaining_s: float, reply: list[Any]) -> None:
        """Block on the wake list until a publish, the next due job, or the deadline."""
        timeout_s = min(remaining_s, MAX_BLOCK_S)
        now_ms, next_due_ms = reply[0], reply[1]
        if next_due_ms:
            # float(): a far score comes back as "1.0e+18", which int() refuses.
            timeout_s = min(timeout_s, max(0.001, (float(next_due_ms) - float(now_ms)) / 1000))
        with self._errors():
            self.client.blpop([wake_key], timeout=max(timeout_s, 0.001))

    def settle(self, queue: str, settlement: Settlement) -> None:
        if not len(settlement):
            return
        self._run("settle", _settle_keys(queue), self._settle_args(settlement))

    def settle_and_take(
        self, queue: str, settlement: Settlement, *, max_jobs: int, lock_timeout_s: float,
        wait_s: float = 0.0, read_ahead: bool = False,
    ) -> list[Delivery]:
        """Settle the last batch and take the next one in one script: one round trip
        (nothing to gain from ``read_ahead``)."""
        if len(settlement):
            settle_args = self._settle_args(settlement)
            lock_ms = max(1, round(lock_timeout_s * 1000))
            reply = self._run(
                "settle_take", _settle_keys(queue),
                [len(settle_args), *settle_args, max_jobs, lock_ms],
            )
            if len(reply) > 2 or wait_s <= 0:
                return _deliveries(reply) if len(reply) > 2 else []
        return self.take(queue, max_jobs=max_jobs, lock_timeout_s=lock_timeout_s, wait_s=wait_s)

    # --- inspecting -----------------------------------------------------------

    def stats(self, queue: str) -> QueueStats:
        k = _keys(queue)
        ready, locked, delayed, dead = self._run("stats", [k["ready"], k["locked"], k["dead"]], [])
        return QueueStats(ready=ready, locked=locked, delayed=delayed, dead=dead)

    def queues(self) -> list[str]:
        if self.cluster:
            return self._cluster_queues()
        with self._errors():
            names: set[bytes] = self.client.smembers(QUEUES_KEY)  # type: ignore[assignment]
            return sorted(name.decode("utf-8", "replace") for name in names)

    def _cluster_queues(self) -> list[str]:
        """Every master's queue registries (see _registry_key), by SCAN: a few keys per
        queue, as jobs are fields of a queue's hash, not keys."""
        prefix, suffix = f"{KEY_PREFIX}:{{", "}:queues"
        with self._errors():
            keys = self.client.scan_iter(match=f"{prefix}*{suffix}", count=1000)
            return sorted({key.decode("utf-8", "replace")[len(prefix):-len(suffix)]
                           for key in keys})

    def dead_jobs(self, queue: str, *, limit: int = 100) -> list[DeadJob]:
        if limit <= 0:
            return []
        return redis_jobs.dead_page(self, _keys, queue, offset=0, limit=limit)[1]

    def dead_page(self, queue: str, *, offset: int = 0, limit: int = 50
                  ) -> tuple[int, list[DeadJob]]:
        return redis_jobs.dead_page(self, _keys, queue, offset=offset, limit=limit)

    def delete_dead(self, queue: str, ids: Sequence[str]) -> int:
        return redis_jobs.dead_by_ids(self, _keys, queue, "delete", ids)

    def job(self, job_id: str, *, queues: Sequence[str] | None = None) -> JobInfo | None:
        return redis_jobs.lookup(self, _keys, job_id, queues)

    def job_page(self, queue: str, state: str, *, offset: int = 0, limit: int = 50,
                 running: Sequence[JobInfo] = ()) -> JobPage:
        return redis_jobs.job_page(self, _keys, queue, state, offset=offset, limit=limit)

    def requeue_dead(self, queue: str, ids: Sequence[str] | None = None) -> int:
        if ids is not None:
            return redis_jobs.dead_by_ids(self, _keys, queue, "requeue", ids)
        k = _keys(queue)
        moved = self._run(
            "requeue_dead", [k["ready"], k["attempts"], k["dead"], k["reasons"], k["errors"]], []
        )
        with self._errors():
            self.client.lpush(k["wake"], "1")
            self.client.ltrim(k["wake"], 0, 15)
        return int(moved)

    def purge(self, queue: str) -> int:
        k = _keys(queue)
        return int(self._run("purge", [k["ready"], k["locked"], k["jobs"], k["attempts"],
                                       k["errors"]], []))

    # --- periodic jobs ------------------------------------------------------------

    def publish_tick(self, queue: str, job: str, tick_ms: int, job_id: str,
                     body: bytes) -> bool:
        """tick.lua: the job and the tick's record in the queue's hash slot, in one step;
        on one Redis the periodic records (``PERIODIC_KEY``) in the same step, on a
        Cluster (another hash slot) right after, raised only: a retry after a late reply
        (RedisCluster retries timeouts) finds the tick recorded and stores nothing."""
        k = _keys(check_queue_name(queue))
        keys = [k["ready"], k["jobs"], self._registry(queue), k["wake"], k["ticks"]]
        if not self.cluster:
            keys.append(PERIODIC_KEY)
        stored, recorded = self._publishing("tick", keys, [job, tick_ms, queue, job_id, body])
        if self.cluster:
            with self._errors():
                self._periodic_script(_RAISE_TICK_LUA)(keys=[PERIODIC_KEY],
                                                       args=[job, int(recorded)])
        return bool(stored)

    def last_ticks(self) -> dict[str, int]:
        """Each job's recorded tick; a field that is not a whole number of ms (another
        program's write, a torn value) is skipped with a warning, so that it cannot stop
        the other jobs' ticks."""
        with self._errors():
            found: dict[Any, Any] = self.client.hgetall(PERIODIC_KEY)
        ticks: dict[str, int] = {}
        for name, value in found.items():
            try:
                ticks[decoded(name)] = int(value)
            except (TypeError, ValueError):
                logger.warning("periodic job %s: its record in %s is not a tick (%r): "
                               "ignored", decoded(name), PERIODIC_KEY, value[:40])
        return ticks

    def _periodic_script(self, source: str) -> Any:
        if source not in self._scripts:
            self._scripts[source] = self.client.register_script(source)
        return self._scripts[source]

    def delete_queue(self, queue: str) -> None:
        """Remove every key of the queue (tests and tooling; loses jobs)."""
        with self._errors():
            self.client.delete(*_keys(queue).values())  # on a Cluster, its registry too
            if not self.cluster:
                self.client.srem(QUEUES_KEY, queue)

    # --- operator controls -----------------------------------------------------

    def read_controls(self) -> dict[str, bytes] | None:
        """One round trip (HGETALL of the controls' hash)."""
        with self._errors():
            stored: dict[bytes, bytes] = self.client.hgetall(CONTROLS_KEY)  # type: ignore[assignment]
        return {key.decode("utf-8", "replace"): value for key, value in stored.items()}

    def write_control(self, key: str, value: bytes | None) -> None:
        with self._errors():
            if value is None:
                self.client.hdel(CONTROLS_KEY, key)
            else:
                self.client.hset(CONTROLS_KEY, key, value)

    def ping(self) -> None:
        with self._errors():
            self.client.ping()

    def close(self) -> None:
        self.client.close()


    def _settle_args(self, settlement: Settlement) -> list[Any]:
        retention = settlement.retention or self._retention
        args: list[Any] = [len(settlement.ack), len(settlement.postpone), len(settlement.dead),
                           len(settlement.release), retention.max_count, retention.max_age_ms]
        args += [d.id for d in settlement.ack]
        for delivery, delay_s in settlement.postpone:
            args += (_wire_id(delivery.id), delivery.receipt, _delay_ms(delay_s))
        for delivery, reason in settlement.dead:
            args += (_wire_id(delivery.id), delivery.receipt, str(reason))
        for delivery in settlement.release:
            args += (_wire_id(delivery.id), delivery.receipt, _activate_ms(delivery.activate_at))
        tail = _tail_args(settlement, retention)
        if settlement.crashed or settlement.refused or settlement.ack_held or tail:  # appended
            args.append(len(settlement.crashed))
            for delivery in settlement.crashed:
                args += (_wire_id(delivery.id), delivery.receipt)
            args.append(len(settlement.refused))
            for delivery, reason in settlement.refused:
                args += (_wire_id(delivery.id), delivery.receipt, str(reason))
            args.append(len(settlement.ack_held))
            for delivery in settlement.ack_held:
                args += (_wire_id(delivery.id), delivery.receipt)
            args += tail
        return args


def _weakest(configs: list[dict[str, str]]) -> dict[str, str]:
    """One configuration for several servers (a Cluster's masters): the one that keeps
    jobs least safely decides (an evicting policy, then no append-only file)."""
    evicting = [c for c in configs if c.get("maxmemory-policy") in EVICTING_POLICIES]
    no_aof = [c for c in configs if c.get("appendonly", "no") != "yes"]
    return (evicting or no_aof or configs or [{}])[0]


def _client_options(retries: int) -> dict[str, Any]:
    """Timeouts, keepalive and retries of every Redis client (one server, Sentinel's
    master, a Cluster's nodes)."""
    return {
        # Only failed connections are retried: a timeout (the server or the link went
        # silent) retried 5 times, with nested retries while connecting, hung for minutes.
        "retry": Retry(ExponentialBackoff(cap=2.0, base=0.05), retries,
                       supported_errors=(redis.ConnectionError,)),
        "retry_on_error": [redis.ConnectionError],
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "socket_timeout": SOCKET_TIMEOUT_S,
        "health_check_interval": HEALTH_CHECK_INTERVAL_S,
        "socket_keepalive": True,
    }


def _warn_once(notes: list[str]) -> None:
    """Log each durability note once per process."""
    for note in notes:
        if note not in _warned_durability:
            _warned_durability.add(note)
            logger.warning("%s", note)


def _settle_keys(queue: str) -> list[str]:
    k = _keys(queue)
    return [k["ready"], k["locked"], k["jobs"], k["attempts"], k["dead"], k["reasons"], k["wake"],
            k["errors"], k["finished"]]


def _tail_args(settlement: Settlement, retention: DeadRetention) -> list[Any]:
    """settle.lua's errors and finished sections; nothing at all (the arguments end
    earlier) when no job failed and the queue keeps no finished records."""
    finished = _finished_args(settlement.ack, retention)
    errors = settlement.errors
    if not errors and not finished:
        return []
    args: list[Any] = [len(errors)]
    texts: dict[int, str] = {}  # a batch that failed as one shares one error: encoded once
    for job_id, error in errors.items():
        text = texts.get(id(error))
        if text is None:
            text = texts[id(error)] = error.to_json()
        args += (_wire_id(job_id), text)
    return args + finished


def _finished_args(acks: Sequence[Delivery], retention: DeadRetention) -> list[Any]:
    """settle.lua's finished section: the acks' takes and attempts, run-length encoded
    (one run for a batch of one take whose jobs never failed)."""
    keep = retention.keep_finished_s
    if keep <= 0 or not acks:
        return []
    runs: list[Any] = []
    last: tuple[float, int] | None = None
    count = 0
    for delivery in acks:
        key = (delivery.taken_at, delivery.attempts)
        if key != last:
            if last is not None:
                runs += (round(last[0] * 1000), last[1], count)
            last, count = key, 0
        count += 1
    assert last is not None
    runs += (round(last[0] * 1000), last[1], count)
    return [round(keep * 1000), FINISHED_MAX_COUNT // 8, len(runs) // 3, *runs]


def _wire_id(job_id: str) -> bytes:
    """The id's stored bytes: an id that was not UTF-8 was read with surrogateescape
    (see _careful_deliveries) and goes back as the same bytes. Acks skip this (the hot
    path): a malformed job is never acked."""
    return job_id.encode("utf-8", "surrogateescape")


def _delay_ms(delay_s: float) -> int:
    """Milliseconds for a delay, never raising: NaN is 0, the rest clamped to [0, 1 year].

    Producers and ``job.retry`` refuse bad delays with a clear error; this is the last
    line, so that one bad value can never make a settle (and the batch's acks) fail.
    """
    if delay_s != delay_s:  # NaN
        return 0
    return round(min(max(delay_s, 0.0), MAX_DELAY_S) * 1000)


def _activate_ms(activate_at: float) -> int:
    return round(activate_at * 1000) if activate_at == activate_at and activate_at < 1e15 else 0




def _settle_take_script() -> str:
    """settle.lua then take.lua in one script; take's keys are settle's first four.

    ARGV: the settle arguments' count, the settle arguments, then take's arguments.
    """
    return (
        "local function settle(KEYS, ARGV)\n" + _load_script("settle") + "\nend\n"
        "local function take(KEYS, ARGV)\n" + _load_script("take") + "\nend\n"
        "local n = tonumber(ARGV[1])\n"
        "settle(KEYS, {unpack(ARGV, 2, n + 1)})\n"
        "return take({KEYS[1], KEYS[2], KEYS[3], KEYS[4]}, {unpack(ARGV, n + 2, #ARGV)})\n"
    )


def _tick_script() -> str:
    """tick.lua with publish.lua as its function ``publish`` (see tick.lua)."""
    return ("local function publish(KEYS, ARGV)\n" + _load_script("publish") + "\nend\n"
            + _load_script("tick"))


def _deliveries(reply: list[Any]) -> list[Delivery]:
    """The take script's reply: now, lock_until, n_suspect, then (id, body, attempts,
    activate_ms) per job; a negative attempts marks a suspect job (see take.lua)."""
    now_s = int(reply[0]) / 1000
    lock_until = reply[1]
    try:
        # Positional arguments and one zip over the four columns: this runs once per job.
        deliveries = [
            Delivery(job_id.decode(), body, int(attempts), float(activate_ms) / 1000, now_s,
                     JSON_CONTENT_TYPE, lock_until)
            for job_id, body, attempts, activate_ms in zip(
                reply[3::4], reply[4::4], reply[5::4], reply[6::4], strict=True)
        ]
    except (UnicodeDecodeError, ValueError):
        deliveries = _careful_deliveries(reply)
    if reply[2]:
        for delivery in deliveries:
            if delivery.attempts < 0:
                delivery.attempts, delivery.suspect = -delivery.attempts, True
    return deliveries


def _careful_deliveries(reply: list[Any]) -> list[Delivery]:
    """The slow path for a take with a job that cannot be read: each such job becomes a
    delivery marked ``malformed`` (the slot dead-letters it) instead of failing the take
    and leaving every job of it locked, to fail again at the next take."""
    now_s = int(reply[0]) / 1000
    deliveries = []
    for job_id, body, attempts, activate_ms in zip(
            reply[3::4], reply[4::4], reply[5::4], reply[6::4], strict=True):
        problem = ""
        try:
            text_id = job_id.decode()
        except UnicodeDecodeError:
            # surrogateescape: _wire_id turns it back into the same bytes when settling.
            text_id, problem = job_id.decode("utf-8", "surrogateescape"), "job id is not UTF-8"
        try:
            activate_s = float(activate_ms) / 1000
        except ValueError:
            activate_s, problem = now_s, problem or f"activation time {activate_ms!r}"
        deliveries.append(Delivery(
            text_id, body, int_or_zero(attempts), activate_s, now_s, JSON_CONTENT_TYPE,
            reply[1], malformed=f"malformed: {problem}" if problem else "",
        ))
    return deliveries


#: Periodic jobs' last enqueued ticks, ``NAME`` -> ms since the epoch (one hash slot).
PERIODIC_KEY = f"{KEY_PREFIX}:{{periodic}}:last"
#: A Cluster's periodic records, raised after tick.lua ran in the queue's hash slot.
_RAISE_TICK_LUA = """
local last = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '-1') or -1
if tonumber(ARGV[2]) <= last then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""
