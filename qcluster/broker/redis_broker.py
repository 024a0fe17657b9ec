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
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from qcluster.broker.base import Broker, DeadJob, QueueStats, Settlement
from qcluster.errors import BrokerError, BrokerUnavailable
from qcluster.job import JSON_CONTENT_TYPE, Delivery

logger = logging.getLogger(__name__)

KEY_PREFIX = "qc"
QUEUES_KEY = f"{KEY_PREFIX}:queues"
#: Lua's unpack() is limited to a few thousand values; publish in chunks below it.
PUBLISH_CHUNK = 500
#: Longest single wait on the wake list, so SIGTERM and delayed jobs are noticed.
MAX_BLOCK_S = 1.0
_CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError)



def _keys(queue: str) -> dict[str, str]:
    base = f"{KEY_PREFIX}:{{{queue}}}"
    return {
        name: f"{base}:{name}"
        for name in ("ready", "locked", "jobs", "attempts", "dead", "reasons", "wake")
    }


def mask_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":**@")
        return urlunsplit(parts._replace(netloc=netloc))
    return url


def _load_script(name: str) -> str:
    return resources.files("qcluster.broker").joinpath("lua", f"{name}.lua").read_text()


class RedisBroker(Broker):
    """Queue server on Redis >= 5 (redis://, rediss://, redis+socket://, unix://)."""

    def __init__(self, client: redis.Redis, *, safe_url: str) -> None:
        self.client = client
        self.safe_url = safe_url
        self._scripts = {
            name: client.register_script(_load_script(name))
            for name in ("take", "settle", "publish", "stats", "requeue_dead", "purge")
        }
        self._scripts["settle_take"] = client.register_script(_settle_take_script())

    @classmethod
    def from_url(cls, url: str, *, retries: int = 5) -> RedisBroker:
        """Connect lazily; transient connection errors are retried with backoff."""
        if url.startswith("redis+socket://"):
            url = "unix://" + url.removeprefix("redis+socket://")
        client = redis.Redis.from_url(
            url,
            retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries),
            retry_on_error=[redis.ConnectionError, redis.TimeoutError],
            socket_connect_timeout=5,
            health_check_interval=30,
        )
        return cls(client, safe_url=mask_url(url))

    @contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except _CONNECTION_ERRORS as exc:
            raise BrokerUnavailable(f"Redis at {self.safe_url} unreachable: {exc}") from exc
        except redis.RedisError as exc:
            raise BrokerError(f"Redis at {self.safe_url}: {exc}") from exc

    def _run(self, script: str, keys: list[str], args: list[Any]) -> Any:
        with self._errors():
            return self._scripts[script](keys=keys, args=args)

    # --- producing ------------------------------------------------------------

    def publish_many(
        self, queue: str, messages: Sequence[tuple[str, bytes]], *, delay_s: float = 0.0
    ) -> None:
        k = _keys(queue)
        keys = [k["ready"], k["jobs"], QUEUES_KEY, k["wake"]]
        delay_ms = max(0, round(delay_s * 1000))
        for start in range(0, len(messages), PUBLISH_CHUNK):
            args: list[Any] = [delay_ms, queue]
            for job_id, body in messages[start : start + PUBLISH_CHUNK]:
                args += (job_id, body)
            self._run("publish", keys, args)

    # --- consuming ------------------------------------------------------------

    def take(
        self, queue: str, *, max_jobs: int, lock_timeout_s: float, wait_s: float = 0.0
    ) -> list[Delivery]:
        k = _keys(queue)
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
            timeout_s = min(timeout_s, max(0.001, (int(next_due_ms) - int(now_ms)) / 1000))
        with self._errors():
            self.client.blpop([wake_key], timeout=max(timeout_s, 0.001))

    def settle(self, queue: str, settlement: Settlement) -> None:
        if not len(settlement):
            return
        self._run("settle", _settle_keys(queue), _settle_args(settlement))

    def settle_and_take(
        self, queue: str, settlement: Settlement, *, max_jobs: int, lock_timeout_s: float,
        wait_s: float = 0.0, read_ahead: bool = False,
    ) -> list[Delivery]:
        """Settle the last batch and take the next one in one script: one round trip
        (nothing to gain from ``read_ahead``)."""
        if len(settlement):
            settle_args = _settle_args(settlement)
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
        with self._errors():
            names: set[bytes] = self.client.smembers(QUEUES_KEY)  # type: ignore[assignment]
            return sorted(name.decode() for name in names)

    def dead_jobs(self, queue: str, *, limit: int = 100) -> list[DeadJob]:
        k = _keys(queue)
        with self._errors():
            entries: list[tuple[bytes, float]] = self.client.zrevrange(  # type: ignore[assignment]
                k["dead"], 0, limit - 1, withscores=True
            )
            if not entries:
                return []
            ids = [job_id for job_id, _ in entries]
            pipe = self.client.pipeline(transaction=False)
            pipe.hmget(k["jobs"], ids)
            pipe.hmget(k["reasons"], ids)
            pipe.hmget(k["attempts"], ids)
            bodies, reasons, attempts = pipe.execute()
        return [
            DeadJob(
                id=job_id.decode(), queue=queue,
                body=(body or b"").decode("utf-8", "replace"),
                reason=(reason or b"").decode("utf-8", "replace"),
                attempts=int(tries or 0), dead_at=score / 1000,
            )
            for (job_id, score), body, reason, tries in zip(
                entries, bodies, reasons, attempts, strict=True
            )
        ]

    def requeue_dead(self, queue: str) -> int:
        k = _keys(queue)
        moved = self._run(
            "requeue_dead", [k["ready"], k["attempts"], k["dead"], k["reasons"]], []
        )
        with self._errors():
            self.client.lpush(k["wake"], "1")
            self.client.ltrim(k["wake"], 0, 15)
        return int(moved)

    def purge(self, queue: str) -> int:
        k = _keys(queue)
        return int(self._run("purge", [k["ready"], k["locked"], k["jobs"], k["attempts"]], []))

    def delete_queue(self, queue: str) -> None:
        """Remove every key of the queue (tests and tooling; loses jobs)."""
        with self._errors():
            self.client.delete(*_keys(queue).values())
            self.client.srem(QUEUES_KEY, queue)

    def ping(self) -> None:
        with self._errors():
            self.client.ping()

    def close(self) -> None:
        self.client.close()


def _settle_keys(queue: str) -> list[str]:
    k = _keys(queue)
    return [k["ready"], k["locked"], k["jobs"], k["attempts"], k["dead"], k["reasons"]]


def _settle_args(settlement: Settlement) -> list[Any]:
    args: list[Any] = [len(settlement.ack), len(settlement.postpone), len(settlement.dead)]
    args += [d.id for d in settlement.ack]
    for delivery, delay_s in settlement.postpone:
        args += (delivery.id, delivery.receipt, max(0, round(delay_s * 1000)))
    for delivery, reason in settlement.dead:
        args += (delivery.id, delivery.receipt, reason)
    return args


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


def _deliveries(reply: list[Any]) -> list[Delivery]:
    """The take script's reply: now, lock_until, then (id, body, attempts, activate_ms)."""
    now_s = int(reply[0]) / 1000
    lock_until = reply[1]
    # Positional arguments and one zip over the four columns: this runs once per job.
    return [
        Delivery(job_id.decode(), body, int(attempts), float(activate_ms) / 1000, now_s,
                 JSON_CONTENT_TYPE, lock_until)
        for job_id, body, attempts, activate_ms in zip(
            reply[2::4], reply[3::4], reply[4::4], reply[5::4], strict=True)
    ]


