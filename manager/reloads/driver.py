"""The service's side of a rolling code reload: starts a rollout, moves it on at every round.

What happens next is decided by ``manager/reloads/rollout.py`` (pure); this keeps the rollout in the
state under the service's lock, logs the decisions and refuses what cannot start.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable
from typing import Any

from qcluster.controls import UNNAMED_TOKEN
from qcluster.manager.reloads.rollout import Rollout, advance, start, take_up_s
from qcluster.manager.state import ClusterState

#: The service's name in the log, as before the service was split.
logger = logging.getLogger(__name__)


class ReloadRefused(ValueError):
    """A reload request the manager does not start: ``status`` is the HTTP answer (404 an
    unknown host, 409 a rollout already running or nobody to reload)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ReloadDriver:
    """Starts rollouts and advances them from the hosts' last reports."""

    def __init__(self, state: ClusterState, lock: threading.RLock,
                 clock: Callable[[], float]) -> None:
        self.state = state
        self.lock = lock
        """The service's state lock."""
        self.clock = clock
        self.take_up_s: float | None = None
        """Seconds a host asked to reload has to show the id before it is skipped (None:
        from the masters' report interval, see :func:`reloads.take_up_s`)."""

    def start(self, host: str | None, by: str = UNNAMED_TOKEN) -> dict[str, Any]:
        """Start a rolling reload of ``host``, or of every reporting host (None) one at a
        time by name; the first host is asked at once (its next reply carries the id).
        Returns the rollout (``status``). Raises ReloadRefused: 404 an unknown host, 409 a
        rollout already running, the host not reporting, or no host reporting."""
        with self.lock:
            now = self.clock()
            hosts = self._hosts_to_reload(host, now)
            rollout = start(f"r{secrets.token_hex(6)}", by, hosts, now)
            logger.info("reload %s of %s asked by %s", rollout.id, ", ".join(hosts), by)
            return self._advance(rollout, now).view()

    def _hosts_to_reload(self, host: str | None, now: float) -> list[str]:
        """(caller holds the lock)"""
        if host is not None and host not in self.state.hosts:
            raise ReloadRefused(404, f"no host named {host} has reported")
        current = self.state.reloads.rollout
        if current is not None and current.running:
            raise ReloadRefused(409, f"reload {current.id} is running (asked by "
                                     f"{current.by}): wait for it to end")
        reporting = self.state.reporting_hosts(now)
        hosts = sorted(reporting) if host is None else [host]
        if not set(hosts) <= set(reporting):
            raise ReloadRefused(409, f"host {host} is not reporting")
        if not hosts:
            raise ReloadRefused(409, "no host is reporting: nothing to reload")
        return hosts

    def status(self) -> dict[str, Any] | None:
        """The rollout running, or the last one (None: none since the manager started)."""
        with self.lock:
            rollout = self.state.reloads.rollout
            return rollout.view() if rollout is not None else None

    def advance(self) -> None:
        """Move the running rollout on from the hosts' last reports (every round)."""
        with self.lock:
            rollout = self.state.reloads.rollout
            if rollout is not None and rollout.running:
                self._advance(rollout, self.clock())

    def _advance(self, rollout: Rollout, now: float) -> Rollout:
        """(caller holds the lock)"""
        limit = self.take_up_s or take_up_s(self.state.cfg.interval_s)
        advanced = advance(rollout, self.state.hosts_seen(now), now, limit)
        self.state.apply_reload(advanced, now)
        for reason in advanced.reasons:
            logger.info("decision: %s", reason)
        return advanced.rollout
