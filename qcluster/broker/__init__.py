"""Broker backends behind one contract, chosen by the URL's kind.

The one place that knows which kind of broker goes to which backend (:func:`backend_module`),
used by :func:`open_broker` and by the master to import the backend before forking slots.
The URL itself is read by :mod:`qcluster.broker.urls`.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from qcluster.broker.base import (
    SHORT_LIVED_GIVE_UP_S,
    Broker,
    DeadJob,
    DeadRetention,
    QueueStats,
    Settlement,
)
from qcluster.broker.urls import BrokerUrl, kind_of, mask_url, parse_broker_url
from qcluster.errors import ConfigError
from qcluster.security import is_loopback

#: The module of each backend (imported lazily: a producer on Redis never loads kombu).
REDIS_MODULE = "qcluster.broker.redis_broker"
KOMBU_MODULE = "qcluster.broker.kombu_broker"
EMBEDDED_MODULE = "qcluster.broker.embedded"
_MODULES = {"embedded": EMBEDDED_MODULE, "redis": REDIS_MODULE, "redis-sentinel": REDIS_MODULE,
            "redis-cluster": REDIS_MODULE, "rabbitmq": KOMBU_MODULE}

__all__ = [
    "SHORT_LIVED_GIVE_UP_S", "Broker", "BrokerUrl", "DeadJob", "DeadRetention", "QueueStats",
    "Settlement", "backend_module", "check_redis_auth", "mask_url", "open_broker",
    "parse_broker_url",
]


def backend_module(url: str | None) -> str:
    """The module implementing the backend for ``url`` (``None``/``"embedded"``: the
    embedded Redis; several URLs joined with ``;``: the first one's).

    Raises:
        ConfigError: the scheme is not supported (one line, naming the supported ones).
    """
    return _MODULES[kind_of(url)]


def check_redis_auth(url: str | BrokerUrl) -> None:
    """Refuse a Redis URL to another machine that carries no password: anyone who reaches
    that Redis could read, change and delete every job. A loopback host, a unix socket, or
    a password (``redis://:PASSWORD@host`` or ``?password=``) pass. Sentinel and Cluster
    URLs need one as soon as one listed host is not this machine (Sentinel hands out the
    master's address, a cluster its nodes': they are where the listed hosts are).

    Raises:
        ConfigError: one line naming the host and how to fix it (or what is wrong with
            the URL).
    """
    parsed = url if isinstance(url, BrokerUrl) else parse_broker_url(url)
    if parsed.kind not in ("redis", "redis-sentinel", "redis-cluster"):
        return  # unix sockets have no hosts: the file's permissions decide who connects
    remote = [host for host, _ in parsed.hosts if not is_loopback(host)]
    if parsed.password or not remote:
        return
    if parsed.is_redis_ha:
        raise ConfigError(
            f"Redis at {parsed.safe()} has no password and {remote[0]!r} is not on this "
            "machine: anyone who reaches it can read, change and delete jobs. Start the "
            "servers with a password (requirepass or an ACL user) and put it in the URL "
            f"({parsed.scheme}://:PASSWORD@HOST:PORT,...)"
        )
    raise ConfigError(
        f"Redis at {parsed.safe()} has no password and is not on this machine: anyone who "
        "reaches it can read, change and delete jobs. Start it with a password (requirepass "
        f"or an ACL user) and put it in the URL (redis://:PASSWORD@{urlsplit(parsed.text).netloc}"
        "/... or ?password=...), or use a loopback address or a unix socket "
        "(redis+socket:///path)"
    )


def open_broker(url: str | None = None, *, state_dir: Path | str = ".qcluster",
                give_up_s: float | None = None) -> Broker:
    """A broker for ``url``; ``None`` or ``"embedded"`` means the embedded Redis.

    Parameters:
        url: ``redis://``, ``rediss://``, ``redis+socket:///path``,
            ``redis+sentinel://HOST:PORT,.../SERVICE``, ``redis+cluster://HOST:PORT,...``,
            ``amqp://`` (several joined with ``;`` fail over), or
            ``embedded``/``embedded:///state/dir``.
        state_dir: where the embedded broker lives when ``url`` does not say.
        give_up_s: for a short-lived caller (:data:`SHORT_LIVED_GIVE_UP_S`): a call that
            cannot reach the broker raises BrokerUnavailable after retrying that long,
            and a Redis is checked for eviction by the first call, not here. None (slots,
            masters, the manager): retried with backoff, 5 times, to ride out a restart.
    Raises:
        ConfigError: the scheme is not supported, or a Redis on another machine has no
            password in the URL (:func:`check_redis_auth`).
    """
    parsed = parse_broker_url(url)
    module = _MODULES[parsed.kind]
    if module == EMBEDDED_MODULE:
        from qcluster.broker.embedded import open_embedded

        return open_embedded(Path(parsed.state_dir or state_dir))
    if module == REDIS_MODULE:
        from qcluster.broker.redis_broker import RedisBroker

        check_redis_auth(parsed)
        redis_broker = RedisBroker.from_url(parsed, give_up_s=give_up_s)
        if give_up_s is None:
            redis_broker.check_durability()  # an evicting server is refused here
        else:
            redis_broker.check_durability_at_first_call()
        return redis_broker
    from qcluster.broker.kombu_broker import KombuBroker

    return KombuBroker(parsed.text, give_up_s=give_up_s)
