"""The Redis backend: the fast path.

Each queue lives in a few keys sharing a hash tag (``qc:{NAME}:...``); activation time
and lock expiry are both scores in time, so delays, retries and expired locks need
no extra process. Taking a batch (with its lock), settling a batch, publishing and
counting are each one Lua script, i.e. one atomic round trip, timed by the Redis
server's clock.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import redis

from qcluster.broker import redis_durability, redis_jobs
from qcluster.broker.base import (
    Broker,
    DeadJob,
    DeadRetention,
    QueueStats,
    Settlement,
    mask_url,
    unreachable,
)
from qcluster.broker.redis_client import (
    CONNECTION_ERRORS,
    cluster_backoff,
    connection_backoff,
    retries_within,
)
from qcluster.broker.redis_client import client_options as _client_options
from qcluster.broker.redis_jobs import decoded
from qcluster.broker.redis_scripts import (
    SCRIPTS,
    compose,
    delay_ms,
    deliveries,
    settle_args,
    take_token,
)
from qcluster.broker.urls import BrokerUrl, parse_broker_url
from qcluster.errors import BrokerError, BrokerUnavailable
from qcluster.job import Delivery
from qcluster.jobs import JobInfo, JobPage
from qcluster.names import check_queue_name
from qcluster.policy import DEFAULT_DEAD_MAX_AGE, DEFAULT_DEAD_MAX_COUNT

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
#: Shortest wait on it. Redis 6.2 (the embedded broker's) reads a BLPOP timeout of 0.001 s
#: as 0, which blocks for ever; 6.2 and 7 both end a block of 2 ms or more at their 100 ms
#: clock tick (hz 10), so a shorter one gains nothing.
MIN_BLOCK_S = 0.01
#: Periodic jobs' last enqueued ticks, ``NAME`` -> ms since the epoch (one hash slot).
PERIODIC_KEY = f"{KEY_PREFIX}:{{periodic}}:last"


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
        self.short_lived = False
        """Set by from_url for a short-lived caller (give_up_s): a command that timed out
        is not tried again (on a Cluster, whose client retries those)."""
        self.replicas = replicas
        self.replica_timeout_ms = replica_timeout_ms
        self.cluster = cluster
        self._unanswered: list[str] = []
        """Cluster masters that did not answer the last durability check."""
        self._silent: list[str] = []
        """Those of them whose PING timed out (redis_durability.refuse_silent_master)."""
        self._stale_slot_map = False
        """A Cluster master did not answer or moved: refresh the slot map before the next
        replicated publish (that path talks to the master directly: see
        redis_durability.server_for)."""
        self._retention = DeadRetention(dead_max_count, dead_max_age_s)
        self._scripts = {name: client.register_script(compose(name)) for name in SCRIPTS}
        self._durability_pending = False
        """check_durability could not reach the server: check before the next call."""
        self._taker = os.urandom(8).hex()
        """Names this broker's take record in each queue (take.lua): one per queue."""
        self._lost_takes: dict[str, tuple[str, list[Any] | None]] = {}
        """Per queue, the token of a take that raised (its reply may have been lost after
        it locked jobs) and the settle arguments it carried. The next take on the queue
        presents it again (see take)."""

    @classmethod
    def from_url(cls, url: str | BrokerUrl, *, retries: int = 5,
                 give_up_s: float | None = None) -> RedisBroker:
        """Connect lazily; failed connections are retried with backoff, ``retries`` times
        or, with ``give_up_s`` (a short-lived caller), as many as fit in that time.

        A server that stops answering is not retried: after SOCKET_TIMEOUT_S the call
        raises BrokerUnavailable (the slot loop pauses and tries again, reconnecting),
        instead of hanging forever on a dead link. TCP keepalive notices a dead peer on
        idle connections.
        """
        parsed = url if isinstance(url, BrokerUrl) else parse_broker_url(url)
        if give_up_s is not None:
            # A Cluster's retries wait longer (redis_ha.cluster_retry).
            retries = retries_within(give_up_s, cluster_backoff()
                                     if parsed.kind == "redis-cluster" else connection_backoff())
        if parsed.is_redis_ha:
            return cls._from_ha_url(parsed, retries=retries, short_lived=give_up_s is not None)
        text = parsed.text
        options = _client_options(retries)
        if parsed.socket_path is not None:  # redis-py reads redis+socket:// as unix://
            text = "unix://" + text.partition("://")[2]
            del options["socket_keepalive"]
        client = redis.Redis.from_url(text, **options)
        return cls(client, safe_url=mask_url(text))

    @classmethod
    def _from_ha_url(cls, parsed: BrokerUrl, *, retries: int,
                     short_lived: bool = False) -> RedisBroker:
        """A master through Sentinel or a Redis Cluster (see redis_ha), with the same
        timeouts and keepalive as one Redis. ``short_lived``: a Cluster command that timed
        out is not retried (one Redis never retries one)."""
        from qcluster.broker import redis_ha

        options = _client_options(retries)
        if parsed.kind == "redis-cluster":
            options["retry"] = redis_ha.cluster_retry(retries, timeouts=not short_lived)
        client = redis_ha.connect(parsed, options, short_lived=short_lived)
        # RedisCluster offers the commands used here under the same names (routed by key).
        broker = cls(cast(redis.Redis, client), safe_url=parsed.safe(),
                     replicas=parsed.replicas, replica_timeout_ms=parsed.replica_timeout_ms,
                     cluster=parsed.kind == "redis-cluster")
        broker.short_lived = short_lived
        return broker

    def redis_client(self) -> Any:
        return self.client

    def durability(self) -> list[str]:
        """Notes on how safely this Redis keeps acknowledged jobs (empty: nothing to say).

        Reads ``CONFIG GET appendonly/save/maxmemory-policy``; a server that disables
        CONFIG (managed Redis often does) gets a note saying it could not be checked.
        Raises ConfigError for an evicting ``maxmemory-policy``: it deletes jobs.
        """
        return redis_durability.durability(self)

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
        redis_durability.warn_once(notes)

    def check_durability_at_first_call(self) -> None:
        """:meth:`check_durability`, left to the first call that reaches the server (a
        short-lived caller: a server that does not answer is then waited for once, by
        that call, not at connect and again by that call). An evicting server is still
        refused before anything is taken or stored."""
        self._durability_pending = True

    @contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except CONNECTION_ERRORS as exc:
            raise BrokerUnavailable(unreachable("Redis", self.safe_url, exc)) from exc
        except redis.exceptions.InvalidResponse as exc:
            # Not a Redis reply at all: the URL names another service (the manager's port,
            # an HTTP server), or the link garbled it. Nothing was stored; the next call
            # opens a new connection.
            raise BrokerUnavailable(
                f"Redis at {self.safe_url} unreachable: what answers there does not speak "
                f"Redis ({exc}): is the host and port right?") from exc
        except redis.RedisError as exc:
            if "maxmemory" in str(exc):  # OOM: a plain command's and a script's wording
                raise BrokerError(
                    f"Redis at {self.safe_url} is full (used memory above its maxmemory): it "
                    "refuses the writes that need memory, new jobs first, until memory is freed "
                    "(slots that finish jobs free it; so do qcluster purge and qcluster dead "
                    "--delete) or maxmemory is raised") from exc
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
        redis_durability.warn_once(notes)

    # --- producing ------------------------------------------------------------

    def publish_many(
        self, queue: str, messages: Sequence[tuple[str, bytes]], *, delay_s: float = 0.0
    ) -> list[str]:
        """Stores the messages whose ids the queue does not hold (publish.lua); returns
        their ids. An id it holds (ready, delayed, locked or dead) is left as it is."""
        k = _keys(check_queue_name(queue))
        keys = [k["ready"], k["jobs"], self._registry(queue), k["wake"]]
        delay = delay_ms(delay_s)
        stored: list[str] = []
        for start in range(0, len(messages), PUBLISH_CHUNK):
            args: list[Any] = [delay, queue]
            for job_id, body in messages[start : start + PUBLISH_CHUNK]:
                args += (job_id, body)
            reply = self._publishing("publish", keys, args)
            stored += (decoded(job_id) for job_id in reply)
        return list(dict.fromkeys(stored))

    def _registry(self, queue: str) -> str:
        return _registry_key(queue) if self.cluster else QUEUES_KEY

    def _publishing(self, script: str, keys: list[str], args: list[Any]) -> Any:
        """A script that stores jobs, followed by ``WAIT`` when publishes wait for
        replicas (see redis_durability.publish_replicated); its reply."""
        if not self.replicas:
            return self._run(script, keys, args)
        if self._durability_pending:
            self._check_durability_late()
            if self.short_lived:
                redis_durability.refuse_silent_master(self, keys[0])
        return redis_durability.publish_replicated(self, script, keys, args)

    # --- consuming ------------------------------------------------------------

    def take(
        self, queue: str, *, max_jobs: int, lock_timeout_s: float, wait_s: float = 0.0
    ) -> list[Delivery]:
        """Every call presents a take token; a call that raises keeps it for the next
        take on the queue, which gets the jobs this one locked if it did (take.lua). A
        retry by redis-py itself, after a connection error, presents it too."""
        k = _keys(check_queue_name(queue))
        # pop: a token is presented by one call at a time, even by threads sharing us.
        lost = self._lost_takes.pop(queue, None)
        token = lost[0] if lost is not None else take_token()
        keys = [k["ready"], k["locked"], k["jobs"], k["attempts"], self._take_record(queue)]
        args = [max_jobs, max(1, round(lock_timeout_s * 1000)), token]
        deadline = time.monotonic() + wait_s
        try:
            while True:
                reply = self._run("take", keys, args)
                if len(reply) > 2:
                    return deliveries(reply)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                self._wait_for_wake(k["wake"], remaining, reply)
        except BrokerError:
            self._lost_takes[queue] = (token, None)
            raise

    def renew_identity(self) -> None:
        """Name a new take record: a broker made before a fork is one per forked process
        (siblings sharing a record would overwrite each other's, and a take whose reply
        was lost would be answered with new jobs, its own left locked to nobody)."""
        self._taker = os.urandom(8).hex()
        self._lost_takes.clear()

    def _take_record(self, queue: str) -> str:
        """This broker's take record in ``queue`` (take.lua), in the queue's hash slot."""
        return f"{KEY_PREFIX}:{{{queue}}}:taken:{self._taker}"

    def _wait_for_wake(self, wake_key: str, remaining_s: float, reply: list[Any]) -> None:
        """Block on the wake list until a publish, the next due job, or the deadline."""
        timeout_s = min(remaining_s, MAX_BLOCK_S)
        now_ms, next_due_ms = reply[0], reply[1]
        if next_due_ms:
            # float(): a far score comes back as "1.0e+18", which int() refuses.
            timeout_s = min(timeout_s, (float(next_due_ms) - float(now_ms)) / 1000)
        with self._errors():
            self.client.blpop([wake_key], timeout=max(timeout_s, MIN_BLOCK_S))

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
            arguments = self._settle_args(settlement)
            lost = self._lost_takes.pop(queue, None)
            if lost is not None and lost[1] != arguments:
                # A replay of the lost take skips the settle it carried (it ran with the
                # take): this other one is settled on its own, then the take replayed.
                self._lost_takes[queue] = (lost[0], None)
                self._run("settle", _settle_keys(queue), arguments)
                return self.take(queue, max_jobs=max_jobs, lock_timeout_s=lock_timeout_s,
                                 wait_s=wait_s)
            token = lost[0] if lost is not None else take_token()
            lock_ms = max(1, round(lock_timeout_s * 1000))
            try:
                reply = self._run(
                    "settle_take", [*_settle_keys(queue), self._take_record(queue)],
                    [len(arguments), *arguments, max_jobs, lock_ms, token],
                )
            except BrokerError:
                self._lost_takes[queue] = (token, arguments)  # see take
                raise
            if len(reply) > 2 or wait_s <= 0:
                return deliveries(reply) if len(reply) > 2 else []
        return self.take(queue, max_jobs=max_jobs, lock_timeout_s=lock_timeout_s, wait_s=wait_s)

    def _settle_args(self, settlement: Settlement) -> list[Any]:
        return settle_args(settlement, settlement.retention or self._retention)

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
                self._scripts["raise_tick"](keys=[PERIODIC_KEY], args=[job, int(recorded)])
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

    def delete_queue(self, queue: str) -> None:
        """Remove every key of the queue (tests and tooling; loses jobs)."""
        with self._errors():
            # On a Cluster, its registry too; and this broker's take record (others' expire).
            self.client.delete(*_keys(queue).values(), self._take_record(queue))
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


def _settle_keys(queue: str) -> list[str]:
    k = _keys(queue)
    return [k["ready"], k["locked"], k["jobs"], k["attempts"], k["dead"], k["reasons"], k["wake"],
            k["errors"], k["finished"]]
