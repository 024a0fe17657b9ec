"""Broker backends behind one contract, chosen by URL scheme."""

from __future__ import annotations

from pathlib import Path

from qcluster.broker.base import Broker, DeadJob, QueueStats, Settlement
from qcluster.errors import ConfigError

REDIS_SCHEMES = ("redis://", "rediss://", "redis+socket://", "unix://")
KOMBU_SCHEMES = ("amqp://", "amqps://", "pyamqp://", "librabbitmq://")
EMBEDDED = "embedded"

__all__ = ["Broker", "DeadJob", "QueueStats", "Settlement", "open_broker", "resolve_broker_url"]


def resolve_broker_url(explicit: str | None, configured: str | None) -> str:
    """explicit argument > QCLUSTER_BROKER_URL / qcluster.toml (``configured``) > embedded."""
    return explicit or configured or EMBEDDED


def open_broker(url: str | None = None, *, state_dir: Path | str = ".qcluster") -> Broker:
    """A broker for ``url``; ``None`` or ``"embedded"`` means the embedded Redis.

    Parameters:
        url: ``redis://``, ``rediss://``, ``redis+socket:///path``, ``amqp://`` (several
            joined with ``;`` fail over), or ``embedded``/``embedded:///state/dir``.
        state_dir: where the embedded broker lives when ``url`` does not say.
    Raises:
        ConfigError: the scheme is not supported.
    """
    url = (url or EMBEDDED).strip()
    if url == EMBEDDED or url.startswith("embedded://"):
        from qcluster.broker.embedded import open_embedded

        path = url.removeprefix("embedded://") if url != EMBEDDED else ""
        return open_embedded(Path(path or state_dir))
    if url.startswith(REDIS_SCHEMES):
        from qcluster.broker.redis_broker import RedisBroker

        redis_broker = RedisBroker.from_url(url)
        redis_broker.check_durability()  # an evicting server is refused here
        return redis_broker
    if url.startswith(KOMBU_SCHEMES):
        from qcluster.broker.kombu_broker import KombuBroker

        return KombuBroker(url)
    raise ConfigError(
        f"unsupported broker URL {url.split('://')[0]!r}://...: use redis://, rediss://, "
        "redis+socket://, amqp:// (RabbitMQ) or leave it unset for the embedded broker"
    )
