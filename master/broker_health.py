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

from qcluster.broker import mask_url, parse_broker_url
from qcluster.errors import ConfigError

CHECK_TIMEOUT_S = 1.0
CACHE_S = 1.0
Address = tuple[int, str | tuple[str, int]]
"""(socket family, address for connect())."""


def broker_addresses(url: str | None, state_dir: Path) -> list[Address]:
    """Where the broker URL (unset: embedded) listens: each host of a RabbitMQ failover
    list, any node of a Redis Cluster or any Sentinel (reaching one is reaching the
    broker's way in: the master is whichever they name), or a unix socket.

    Raises:
        ValueError: the URL is refused (one line, as the slots will say it).
    """
    try:
        parsed = parse_broker_url(url)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    if parsed.kind == "embedded":
        from qcluster.broker.embedded import socket_path

        where = Path(parsed.state_dir) if parsed.state_dir else state_dir
        return [(socket.AF_UNIX, str(socket_path(where)))]
    addresses: list[Address] = []
    if parsed.socket_path is not None:
        addresses.append((socket.AF_UNIX, parsed.socket_path))
    addresses += [(socket.AF_INET6 if ":" in host else socket.AF_INET, (host, port))
                  for host, port in parsed.hosts]
    return addresses


class BrokerConnectCheck:
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
