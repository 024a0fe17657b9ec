"""How qcluster talks to any Redis: timeouts, keepalive, retries, and the errors that
mean "not reachable now" (one server, Sentinel's master, a Cluster's nodes alike).

Both :mod:`qcluster.broker.redis_broker` and :mod:`qcluster.broker.redis_ha` build their
clients from here, so neither imports the other for it.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.backoff import AbstractBackoff, ExponentialBackoff
from redis.retry import Retry

try:
    from redis.driver_info import DriverInfo as _DriverInfo
except ImportError:  # redis-py < 7.1 reads its version once, at import
    _DriverInfo = None  # type: ignore[assignment,misc]

#: A reply slower than this ends the call with BrokerUnavailable (a silent server or a
#: dead link must not hang producers and slots); above MAX_BLOCK_S, the longest wait.
SOCKET_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 5.0
#: Seconds idle after which a pooled connection is pinged before its next use.
HEALTH_CHECK_INTERVAL_S = 10
#: RedisClusterException: no node of a Cluster answered; CLUSTERDOWN: a shard has no
#: master (yet): both pass once the cluster is back, like a connection error.
CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError,
                     redis.exceptions.RedisClusterException, redis.exceptions.ClusterDownError)
#: Replies and errors of a Cluster master that died, is failing over or gave its slots away.
SLOT_MAP_CHANGES = (
    redis.ConnectionError, redis.TimeoutError, redis.exceptions.MovedError,
    redis.exceptions.AskError, redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
)


#: The most retries :func:`retries_within` gives (a backoff that does not wait would fit any
#: number).
MAX_RETRIES = 100


def connection_backoff() -> ExponentialBackoff:
    """The wait before each retry of a failed connection: 0.1 s, doubling, at most 2 s."""
    return ExponentialBackoff(cap=2.0, base=0.05)


def cluster_backoff() -> ExponentialBackoff:
    """The wait before each of a Cluster command's retries: 0.2 s, doubling, at most 2 s
    (redis_ha.cluster_retry)."""
    return ExponentialBackoff(cap=2.0, base=0.1)


def retries_within(give_up_s: float, backoff: AbstractBackoff) -> int:
    """How many retries of a failed connection fit in ``give_up_s`` of ``backoff``'s
    waits (redis-py counts retries, not time): at least one, so that a pooled connection
    the server closed (it restarted) is opened again rather than reported."""
    retries, waited = 0, 0.0
    while retries < MAX_RETRIES and waited + (wait := backoff.compute(retries + 1)) <= give_up_s:
        retries, waited = retries + 1, waited + wait
    return max(retries, 1)


def client_options(retries: int) -> dict[str, Any]:
    """Timeouts, keepalive and retries of every Redis client (one server, Sentinel's
    master, a Cluster's nodes).

    A retry after a connection error sends the same command again: a take presents the
    same take token, and gets the jobs the first try locked if it ran (take.lua)."""
    options: dict[str, Any] = {
        # Only failed connections are retried: a timeout (the server or the link went
        # silent) retried 5 times, with nested retries while connecting, hung for minutes.
        "retry": Retry(connection_backoff(), retries,
                       supported_errors=(redis.ConnectionError,)),
        "retry_on_error": [redis.ConnectionError],
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "socket_timeout": SOCKET_TIMEOUT_S,
        "health_check_interval": HEALTH_CHECK_INTERVAL_S,
        "socket_keepalive": True,
    }
    if _DriverInfo is not None:
        # Told, not looked up: redis-py >= 7.1 reads its own version from the installed
        # package's metadata for every client (an email parse of METADATA), which in a
        # forked slot dirtied 1.2 MiB of the pages it shares with its master.
        options["driver_info"] = _DriverInfo(lib_version=redis.__version__)
    return options
