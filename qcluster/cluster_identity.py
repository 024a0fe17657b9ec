"""One cluster, one broker: the identity a broker carries, so that a master or manager
working on another broker than the manager's is refused instead of silently planning 0
slots while the jobs wait elsewhere.

The first manager or master to open a broker writes a random identity into it (the
broker's durable controls store, ``Broker.write_control``, under :data:`IDENTITY_KEY`),
and every later one reads it back. Masters report theirs (``HostReport.cluster``, with
the broker's masked URL); the manager compares it with its own and refuses a report from
another broker (409, one line naming both URLs), and a master checks the manager's before
its first fork (:data:`WrongBroker`, exit code 8).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable

from qcluster.broker.base import Broker
from qcluster.errors import BrokerError, QClusterError
from qcluster.messages import ClusterClaim

logger = logging.getLogger(__name__)

#: The controls store key of the identity (not a ``pause:``/``drain:`` control).
IDENTITY_KEY = "cluster:identity"
#: Every key of the controls store this module owns starts with this.
RESERVED_PREFIX = "cluster:"
#: Seconds a first writer waits before reading the identity back: two processes opening a
#: fresh broker together both write one; both then read the last written, the same.
SETTLE_S = 0.5
#: Reads of a store that answered "not readable just now" (RabbitMQ: another process holds
#: the controls for a moment) before giving up.
READ_TRIES = 10


class WrongBroker(QClusterError):
    """This process and the manager work on different brokers."""


def claim(broker: Broker, *,
          sleep: Callable[[float], None] = time.sleep) -> ClusterClaim | None:
    """This broker's identity, written first if it has none; None when the broker cannot
    keep one (a backend without a controls store: ``Broker.read_controls`` raises
    NotImplementedError) or does not answer just now."""
    try:
        identity = _read(broker, sleep)
        if identity is None:
            broker.write_control(IDENTITY_KEY, secrets.token_hex(16).encode())
            sleep(SETTLE_S)
            identity = _read(broker, sleep)
    except (BrokerError, NotImplementedError) as exc:
        logger.warning("cannot read the cluster identity from the broker (%s): a manager on "
                       "another broker will not be noticed", exc)
        return None
    if identity is None:
        return None
    return ClusterClaim(id=identity, broker=broker.safe_url)


def _read(broker: Broker, sleep: Callable[[float], None]) -> str | None:
    for _ in range(READ_TRIES):
        stored = broker.read_controls()
        if stored is not None:
            value = stored.get(IDENTITY_KEY)
            if not value:
                return None
            text = value.decode("ascii", "replace").strip()
            try:
                return ClusterClaim(id=text, broker="").id
            except ValueError:
                return None  # not ours: written again
        sleep(0.2)
    return None


def mismatch(manager: ClusterClaim | None, other: ClusterClaim | None, *,
             who: str, manager_url: str = "") -> str | None:
    """The one-line refusal when ``other`` (a master, another manager) works on another
    broker than the manager; None when they agree or either is unknown."""
    if manager is None or other is None or manager.id == other.id:
        return None
    at = f" at {manager_url}" if manager_url else ""
    return (f"{who} uses the broker {other.broker}, but the manager{at} uses "
            f"{manager.broker}: they are different brokers (cluster {other.id[:8]} vs "
            f"{manager.id[:8]}); give every process of the cluster the same --broker / "
            "QCLUSTER_BROKER_URL")
