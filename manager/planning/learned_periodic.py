"""Periodic jobs run where the app runs: the manager learns ``@app.periodic`` declarations
from the masters' reports (``HostReport.periodic``: the masters import the app; the
manager often does not), merges them with its own ``[periodic.NAME]`` configuration and
hands the result to its ticker (``manager/planning/periodic.py``), started on the first job.

What it cannot know of is said on the admin page (a periodic row whose schedule says why)
and in the log, once: a ``[periodic.NAME]`` that changes a job no reporting master's app
declares (it runs once a master reports the declaration), or two masters declaring one job
differently (the newest report wins: during a rolling reload both versions report).
"""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace
from typing import Any

from qcluster.config import Settings
from qcluster.errors import ConfigError
from qcluster.periodic import PeriodicJobView, PeriodicSpec

logger = logging.getLogger(__name__)

SCHEDULE_FIELDS = ("cron", "every")


def complete(fields: dict[str, Any], declared: PeriodicSpec | None) -> bool:
    """Whether ``[periodic.NAME]`` with ``fields`` makes a job on its own or over its
    declaration: a queue and a schedule, from either."""
    if declared is not None:
        return True
    return "queue" in fields and any(key in fields for key in SCHEDULE_FIELDS)


def without_partial(settings: Settings) -> Settings:
    """The settings without the ``[periodic.NAME]`` entries that only change a declaration
    the manager has not learned yet (they wait for a master's report)."""
    kept = {name: fields for name, fields in settings.periodic.items() if complete(fields, None)}
    return settings.model_copy(update={"periodic": kept})


class LearnedPeriodic:
    """The masters' declarations, merged with the configuration, kept in the ticker."""

    def __init__(self, service: Any, settings: Settings,
                 app_jobs: dict[str, PeriodicSpec] | None = None) -> None:
        self.service = service
        self.settings = settings
        self.app_jobs = dict(app_jobs or {})
        """The manager's own ``--app`` / ``app`` declarations, when it could import it."""
        self.declared: dict[str, tuple[str, PeriodicSpec]] = {}
        """Job name -> (the host that reported it last, its declaration)."""
        self.pending: dict[str, str] = {}
        """Job name -> why the manager cannot run it (shown on the page, logged once)."""
        self.lock = threading.Lock()
        self.apply_lock = threading.Lock()
        """One apply at a time: two reports at once must not start two tickers."""
        self._warned: set[tuple[str, str]] = set()
        self.apply()

    def learn(self, host: str, declared: dict[str, PeriodicSpec]) -> None:
        """A master's report: its app's declarations (applied when they change)."""
        changed = []
        with self.lock:
            for name, spec in declared.items():
                current = self.declared.get(name)
                if current is not None and current[1] == spec:
                    continue
                if current is not None and current[0] != host:
                    self._warn(name, f"periodic {name}: master {current[0]} and master {host} "
                                     f"declare it differently; {host}'s (the newest) is used")
                self.declared[name] = (host, spec)
                changed.append(name)
        if changed:
            logger.info("periodic jobs learned from master %s: %s", host, ", ".join(changed))
            self.apply()

    def merged(self) -> tuple[dict[str, PeriodicSpec], dict[str, str]]:
        """The jobs to run and the ones that wait (name -> why)."""
        from qcluster.manager.planning.periodic import configured_jobs

        with self.lock:
            declared = {name: spec for name, (_, spec) in self.declared.items()}
        declared.update(self.app_jobs)
        ready = {}
        pending = {}
        for name, fields in self.settings.periodic.items():
            if complete(fields, declared.get(name)):
                ready[name] = fields
            else:
                pending[name] = (f"[periodic.{name}] changes a job no reporting master's app "
                                 "declares (yet): it runs once a master reports it")
        try:
            jobs = configured_jobs(self.settings.model_copy(update={"periodic": ready}),
                                   SimpleNamespace(periodic_jobs=declared))  # type: ignore[arg-type]
        except ConfigError as exc:  # a master's declaration and the file disagree
            self._warn("config", f"periodic jobs: {exc}")
            jobs = dict(declared)
        return jobs, pending

    def apply(self) -> None:
        """Hand the merged jobs to the ticker (started on the first job)."""
        with self.apply_lock:
            self._apply()

    def _apply(self) -> None:
        from qcluster.manager.planning.periodic import PeriodicTicker

        jobs, self.pending = self.merged()
        for name, why in self.pending.items():
            self._warn(name, f"periodic {name}: {why}")
        if not jobs:
            return
        ticker = self.service.periodic
        if ticker is not None:
            ticker.jobs = jobs  # one assignment: a pass reads the old or the new dict whole
            return
        ticker = PeriodicTicker(jobs, self.service.broker, self.service.broker_lock,
                                self.service.clock)
        self.service.periodic = ticker
        running = getattr(self.service, "_thread", None) is not None
        if running and not self.service.stopped.is_set():  # else the service starts it
            ticker.start()

    def pending_views(self) -> list[PeriodicJobView]:
        """The jobs that wait, as rows of the page's periodic table (the reason in place of
        the schedule)."""
        return [PeriodicJobView(name=name, queue=str(self.settings.periodic[name].get("queue",
                                                                                      "?")),
                                schedule=f"not running: {why}", catch_up="-", last_run=None,
                                next_run=0.0)
                for name, why in sorted(self.pending.items())]

    def _warn(self, key: str, message: str) -> None:
        if (key, message) not in self._warned:
            self._warned.add((key, message))
            logger.warning("%s", message)
