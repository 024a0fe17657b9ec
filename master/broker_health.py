"""Does this host reach its broker? What /healthz says: ``ok``, or ``degraded`` with the
reason while the broker's address refuses or does not answer a connection.

The master itself holds no broker connection (its slots each open their own after the
fork), so the check is a plain connect to the broker's address (TCP, or the unix socket of
the embedded or a ``redis+socket://`` broker), at most once per ``CACHE_S``, with a short
timeout. The socket is open only while the fork lock is held: a slot forked meanwhile
would otherwise inherit it and keep the connection open for its whole life.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from qcluster.broker import mask_url

DEFAULT_PORTS = {"redis": 6379, "rediss": 6379, "amqp": 5672, "pyamqp": 5672, "amqps": 5671}
UNIX_SCHEMES = ("redis+socket", "unix")
HA_SCHEMES = ("redis+sentinel://", "redis+cluster://")
CHECK_TIMEOUT_S = 1.0
CACHE_S = 1.0
Address = tuple[int, str | tuple[str, int]]
"""(socket family, address for connect())."""


def broker_addresses(url: str | None, state_dir: Path) -> list[Address]:
    """Where each of the broker URLs (``;``-separated, or none: embedded) listens."""
    addresses: list[Address] = []
    for one in filter(None, (u.strip() for u in (url or "embedded").split(";"))):
        if one == "embedded" or one.startswith("embedded://"):
            from qcluster.broker.embedded import socket_path

            addresses.append((socket.AF_UNIX, str(socket_path(state_dir))))
            continue
        if one.startswith(HA_SCHEMES):  # a host list: any node (or Sentinel) answering
            addresses.extend(_ha_addresses(one))
            continue
        parts = urlsplit(one)
        if parts.scheme in UNIX_SCHEMES:
            addresses.append((socket.AF_UNIX, parts.path))
        elif parts.hostname:
            port = parts.port or DEFAULT_PORTS.get(parts.scheme, 0)
            family = socket.AF_INET6 if ":" in parts.hostname else socket.AF_INET
            addresses.append((family, (parts.hostname, port)))
    return addresses


def _ha_addresses(url: str) -> list[Address]:
    """The nodes of a Redis Cluster URL, or the Sentinels of a Sentinel one (the master is
    whichever they name: reaching one of them is reaching the broker's way in)."""
    from qcluster.broker.redis_ha import parse_ha_url
    from qcluster.errors import ConfigError

    try:
        parsed = parse_ha_url(url)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    return [(socket.AF_INET6 if ":" in host else socket.AF_INET, (host, port))
            for host, port in parsed.hosts]


class BrokerHealth:
    def __init__(self, url: str | None, state_dir: Path, fork_lock: threading.Lock,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.url = url
        self.state_dir = state_dir
        self._fork_lock = fork_lock
        self._clock = clock
        self._lock = threading.Lock()
        self._checked_at: float | None = None
        self._problem: str | None = None

    def status(self) -> dict[str, str]:
        """``{"status": "ok"}`` or ``{"status": "degraded", "broker": REASON}``."""
        with self._lock:
            now = self._clock()
            if self._checked_at is None or now - self._checked_at >= CACHE_S:
                self._problem = self._check()
                self._checked_at = self._clock()
            problem = self._problem
        return {"status": "ok"} if problem is None else {"status": "degraded", "broker": problem}

    def _check(self) -> str | None:
        """None when one of the addresses accepts a connection, else why not (one line)."""
        try:
            addresses = broker_addresses(self.url, self.state_dir)
        except ValueError as exc:  # a bad port or host list: the slots say more
            return f"broker URL {mask_url(self.url or '')}: {exc}"
        problem = f"no address in broker URL {mask_url(self.url or '')}"
        for family, address in addresses:
            try:
                with self._fork_lock, socket.socket(family, socket.SOCK_STREAM) as sock:
                    sock.settimeout(CHECK_TIMEOUT_S)
                    sock.connect(address)
                return None
            except OSError as exc:
                shown = address if isinstance(address, str) else f"{address[0]}:{address[1]}"
                problem = f"cannot connect to {shown}: {exc.strerror or exc}"
        return problem
