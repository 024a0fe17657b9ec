"""Broker backends behind one contract, chosen by URL scheme.

The one place that knows which URL scheme goes to which backend (:func:`backend_module`),
used by :func:`open_broker` and by the master to import the backend before forking slots.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

from qcluster.broker.base import (
    Broker,
    DeadJob,
    DeadRetention,
    QueueStats,
    Settlement,
    mask_url,
)
from qcluster.errors import ConfigError
from qcluster.security import is_loopback

REDIS_SCHEMES = ("redis://", "rediss://", "redis+socket://", "unix://",
                 "redis+sentinel://", "redis+cluster://")
#: A master found through Sentinel, a Redis Cluster (qcluster/broker/redis_ha.py).
REDIS_HA_SCHEMES = ("redis+sentinel://", "redis+cluster://")
#: py-amqp only: the backend reads frames through its own transport (amqp_readahead) and
#: sends heartbeats from a thread, which kombu's librabbitmq transport does not allow.
KOMBU_SCHEMES = ("amqp://", "amqps://", "pyamqp://")
EMBEDDED = "embedded"
EMBEDDED_PREFIX = "embedded://"

#: The module of each backend (imported lazily: a producer on Redis never loads kombu).
REDIS_MODULE = "qcluster.broker.redis_broker"
KOMBU_MODULE = "qcluster.broker.kombu_broker"
EMBEDDED_MODULE = "qcluster.broker.embedded"

__all__ = [
    "Broker", "DeadJob", "DeadRetention", "QueueStats", "Settlement", "backend_module",
    "check_redis_auth", "mask_url", "open_broker",
]


def backend_module(url: str | None) -> str:
    """The module implementing the backend for ``url`` (``None``/``"embedded"``: the
    embedded Redis; several URLs joined with ``;``: the first one's).

    Raises:
        ConfigError: the scheme is not supported (one line, naming the supported ones).
    """
    first = (url or EMBEDDED).strip().split(";")[0].strip()
    if first == EMBEDDED or first.startswith(EMBEDDED_PREFIX):
        return EMBEDDED_MODULE
    if first.startswith(REDIS_SCHEMES):
        return REDIS_MODULE
    if first.startswith(KOMBU_SCHEMES):
        return KOMBU_MODULE
    scheme, has_scheme, _ = first.partition("://")
    shown = (f"{scheme[:40]!r}://..." if has_scheme and scheme.isprintable()
             and not set(scheme) & set(":@/") else "without a scheme")  # never a password
    raise ConfigError(
        f"unsupported broker URL {shown}: use redis://, rediss://, redis+socket://, "
        "redis+sentinel://, redis+cluster://, amqp:// (RabbitMQ) or leave it unset for the "
        "embedded broker"
    )


def check_redis_auth(url: str) -> None:
    """Refuse a ``redis://``/``rediss://`` URL to another machine that carries no password:
    anyone who reaches that Redis could read, change and delete every job. A loopback
    host, a unix socket, or a password (``redis://:PASSWORD@host`` or ``?password=``) pass.

    Raises:
        ConfigError: one line naming the host and how to fix it.
    """
    if url.startswith(REDIS_HA_SCHEMES):
        _check_ha_auth(url)
        return
    if not url.startswith(("redis://", "rediss://")):
        return  # unix sockets: the file's permissions decide who connects
    try:
        parts = urlsplit(url)
        host, password = parts.hostname or "", parts.password
    except ValueError:
        return  # redis-py says what is wrong with it
    if password or any(key.strip().lower() == "password" and value
                       for key, value in parse_qsl(parts.query, keep_blank_values=True)):
        return
    if not host or is_loopback(host):
        return
    raise ConfigError(
        f"Redis at {mask_url(url)} has no password and is not on this machine: anyone who "
        "reaches it can read, change and delete jobs. Start it with a password (requirepass "
        f"or an ACL user) and put it in the URL (redis://:PASSWORD@{parts.netloc}/... or "
        "?password=...), or use a loopback address or a unix socket (redis+socket:///path)"
    )


def _check_ha_auth(url: str) -> None:
    """check_redis_auth for Sentinel and Cluster URLs: a password is needed as soon as one
    of the listed hosts is not this machine (Sentinel hands out the master's address, a
    cluster its nodes': they are where the listed hosts are)."""
    from qcluster.broker.redis_ha import parse_ha_url

    parsed = parse_ha_url(url)
    remote = [host for host, _ in parsed.hosts if not is_loopback(host)]
    if parsed.password or not remote:
        return
    raise ConfigError(
        f"Redis at {parsed.safe()} has no password and {remote[0]!r} is not on this machine: "
        "anyone who reaches it can read, change and delete jobs. Start the servers with a "
        "password (requirepass or an ACL user) and put it in the URL "
        f"(redis+{parsed.kind}://:PASSWORD@HOST:PORT,...)"
    )


def open_broker(url: str | None = None, *, state_dir: Path | str = ".qcluster") -> Broker:
    """A broker for ``url``; ``None`` or ``"embedded"`` means the embedded Redis.

    Parameters:
        url: ``redis://``, ``rediss://``, ``redis+socket:///path``,
            ``redis+sentinel://HOST:PORT,.../SERVICE``, ``redis+cluster://HOST:PORT,...``,
            ``amqp://`` (several joined with ``;`` fail over), or
            ``embedded``/``embedded:///state/dir``.
        state_dir: where the embedded broker lives when ``url`` does not say.
    Raises:
        ConfigError: the scheme is not supported, or a Redis on another machine has no
            password in the URL (:func:`check_redis_auth`).
    """
    url = (url or EMBEDDED).strip()
    module = backend_module(url)
    if module == EMBEDDED_MODULE:
        from qcluster.broker.embedded import open_embedded

        path = url.removeprefix(EMBEDDED_PREFIX) if url != EMBEDDED else ""
        return open_embedded(Path(path or state_dir))
    if module == REDIS_MODULE:
        from qcluster.broker.redis_broker import RedisBroker

        check_redis_auth(url)
        redis_broker = RedisBroker.from_url(url)
        redis_broker.check_durability()  # an evicting server is refused here
        return redis_broker
    from qcluster.broker.kombu_broker import KombuBroker

    return KombuBroker(url)
