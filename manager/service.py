"""The manager's service: what the HTTP routes (``manager/api/app.py``), the admin pages and
the masters' reports call, on top of the planning loop (``manager/planning/round_loop.py``: the
state, the broker and their locks; a round every ``interval_s``, observe -> decide -> act).

Started and stopped by the FastAPI lifespan (``create_app``).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from qcluster.broker.base import Broker, DeadJob
from qcluster.broker.health import BrokerHealth
from qcluster.controls import UNNAMED_TOKEN, Control
from qcluster.jobs import JobInfo, JobPage
from qcluster.manager.broker_watch import BROKER_CHECK_INTERVAL_S
from qcluster.manager.controls.store import ControlStore
from qcluster.manager.held_lookup import HeldLookup, LookupsBusy
from qcluster.manager.host_owners import HostOwners
from qcluster.manager.job_reads import JobReads, JobReadsBusy
from qcluster.manager.planning.periodic import PeriodicJobView
from qcluster.manager.planning.recorder import Recorder
from qcluster.manager.planning.round_loop import STOP_WAIT_S, RoundLoop
from qcluster.manager.planning.rounds import RoundResult
from qcluster.manager.reloads.driver import ReloadRefused
from qcluster.manager.state import ClusterState
from qcluster.manager.views import QueueRows, cluster_view, queue_rows_key, queue_views
from qcluster.messages import (
    FINDS_JOBS_SINCE,
    Assignment,
    ClusterView,
    HistoryPoint,
    HostReport,
    RefusalReason,
    RefusedReportView,
)

logger = logging.getLogger(__name__)

#: The longest a lookup waits for the masters' answers (two report intervals and a second
#: otherwise): a client's request must not outlast its own timeout.
MAX_LOOKUP_WAIT_S = 10.0

__all__ = ["BROKER_CHECK_INTERVAL_S", "STOP_WAIT_S", "ManagerService", "ReloadRefused"]


class ManagerService(RoundLoop):
    """What the API, the admin UI and the loop work on.

    Implements admin_ui.source.ClusterSource.
    """

    def __init__(self, state: ClusterState, broker: Broker, token: str | None,
                 clock: Callable[[], float] = time.time,
                 recorder: Recorder | None = None,
                 tokens: dict[str, str] | None = None) -> None:
        super().__init__(state, broker, clock, recorder)
        self.tokens: dict[str, str] = dict(state.settings.tokens if tokens is None else tokens)
        """Token name -> secret: ``[tokens]`` and the unnamed ``token`` (named "token")."""
        if token:
            self.tokens[UNNAMED_TOKEN] = token
        self.queue_rows = QueueRows()
        self.learned: Any = None
        """The masters' ``@app.periodic`` declarations (manager/planning/learned_periodic.py)."""
        self.job_reads = JobReads(lambda: self.broker)
        """Job lookups and pages: off ``broker_lock`` (manager/job_reads.py)."""
        self.holders = HeldLookup()
        self.owners = HostOwners()
        """The master holding each host name (two masters under one name are refused)."""
        self.refused: dict[tuple[str, RefusalReason], tuple[float, str]] = {}
        """(host, reason) -> when a report under that host name was last refused (409),
        and the refusal's line."""
        """Jobs looked up that the broker cannot place, asked of the masters."""
        self.reporting: set[str] = set()
        """The hosts reporting at the last round: the log says when one stops or starts."""
        self.ever_reported: set[str] = set()

    def act(self, result: RoundResult) -> None:
        super().act(result)
        self.log_hosts(result.now)

    def log_hosts(self, now: float) -> None:
        """One line when a host starts, stops or starts again reporting: a master killed
        (SIGKILL, a host lost) otherwise leaves nothing in the manager's log but the
        decisions that move its slots."""
        with self.lock:
            reporting = self.state.reporting_hosts(now)
            last = {name: (entry.received_at, entry.report.capacity_slots)
                    for name, entry in self.state.hosts.items()}
        for name in sorted(reporting.keys() - self.reporting):
            again = " again" if name in self.ever_reported else ""
            logger.info("host %s reporting%s (capacity %d slots)", name, again, last[name][1])
        for name in sorted(self.reporting - reporting.keys()):
            if name in last:
                logger.warning("host %s stopped reporting (last report %.0f s ago): its slots "
                               "are planned on the other hosts", name, now - last[name][0])
        self.reporting = set(reporting)
        self.ever_reported |= self.reporting

    # --- commands: the routes' and the masters' ------------------------------------

    def receive(self, report: HostReport) -> Assignment:
        """A master's report; the reply is its row of the slot map."""
        with self.lock:
            assignment = self.state.receive(report, self.clock())
        return self._asking(report, assignment)

    def try_receive(self, report: HostReport) -> Assignment | None:
        """``receive`` if the state lock is free at once; None (nothing stored) if another
        thread holds it: the event loop never waits for the lock, a pool thread does."""
        if not self.lock.acquire(blocking=False):
            return None
        try:
            assignment = self.state.receive(report, self.clock())
        finally:
            self.lock.release()
        return self._asking(report, assignment)

    def _asking(self, report: HostReport, assignment: Assignment) -> Assignment:
        """The report's answers to the job lookups recorded, and the reply naming the jobs
        the lookups still want found (manager/held_lookup.py), to masters that answer."""
        self.holders.answered(report.host, report.searched, report.held)
        if report.schema_version < FINDS_JOBS_SINCE:
            return assignment  # an older master refuses a reply with fields it does not know
        wanted = self.holders.wanted()
        return assignment.model_copy(update={"find_jobs": wanted}) if wanted else assignment

    def pause(self, queue: str, by: str = UNNAMED_TOKEN) -> Control:
        """Plan no slot for the queue until it is resumed (from the next round); kept in
        the broker, so a restarted manager keeps it. Raises BrokerError when the broker
        cannot store it (nothing changes then)."""
        return self.desk.set("pause", queue, by)

    def refuse(self, host: str, reason: RefusalReason, detail: str) -> None:
        """A report under ``host`` was refused for ``reason`` (``another_broker``,
        ``two_masters``): shown by the page and ``/metrics`` while it goes on."""
        self.refused[(host, reason)] = (self.clock(), detail)

    def refused_now(self) -> list[RefusedReportView]:
        """The refusals within the last expiry of a host, by host name."""
        now, within = self.clock(), self.state.expiry_s(self.state.cfg.interval_s)
        return [RefusedReportView(host=host, reason=reason, detail=detail, at=at)
                for (host, reason), (at, detail) in sorted(list(self.refused.items()))
                if now - at <= within]

    def leave(self, host: str) -> bool:
        """A master that stopped cleanly: forget its host (False: not known)."""
        self.owners.forget(host)
        with self.lock:
            known = self.state.forget_host(host)
            self.reporting.discard(host)
        if known:
            logger.info("host %s left: its master stopped", host)
        return known

    def known_names(self, kind: str) -> set[str]:
        """The queues (``pause``) or hosts (``drain``) this manager has heard of since its
        start: a control on another name is kept but changes nothing until one appears."""
        with self.lock:
            if kind == "drain":
                return set(self.state.hosts)
            return set(self.state.policies()) | set(self.state.stats)

    def resume(self, queue: str) -> None:
        self.desk.clear("pause", queue)

    def drain(self, host: str, by: str = UNNAMED_TOKEN) -> Control:
        """Plan no slot on the host until it is undrained: its next reply is an empty
        row, and the next round places its slots on the others. Kept in the broker."""
        return self.desk.set("drain", host, by)

    def undrain(self, host: str) -> None:
        self.desk.clear("drain", host)

    def controls(self) -> list[Control]:
        """The pauses and drains in force, with who set them and when (by kind, name)."""
        return self.desk.in_force()

    @property
    def control_store(self) -> ControlStore:
        """Pause and drain, kept in the broker (``manager/controls/store.py``)."""
        return self.desk.store

    @control_store.setter
    def control_store(self, store: ControlStore) -> None:
        self.desk.store = store

    def reload(self, host: str | None, by: str = UNNAMED_TOKEN) -> dict[str, Any]:
        """Start a rolling reload of ``host``, or of every reporting host (None) one at a
        time by name; the first host is asked at once (its next reply carries the id).
        Returns the rollout (``reload_status``). Raises ReloadRefused: 404 an unknown host,
        409 a rollout already running, the host not reporting, or no host reporting."""
        return self.reloads.start(host, by)

    def reload_status(self) -> dict[str, Any] | None:
        """The rollout running, or the last one (None: none since the manager started)."""
        return self.reloads.status()

    # --- ClusterSource -------------------------------------------------------------

    def cluster_view(self) -> ClusterView:
        """The view the API and the page show; its queue rows built once per round
        (``manager.views.QueueRows``)."""
        with self.lock:
            now = self.clock()
            key = queue_rows_key(self.state, now)
            rows = self.queue_rows.held(key)
            snapshot = self.state.snapshot(now, queues_too=rows is None)
        if rows is None:
            rows = queue_views(snapshot)
            with self.lock:
                self.queue_rows.keep(key, rows)
        view = cluster_view(snapshot, rows)
        refused = self.refused_now()
        return view.model_copy(update={"refused_reports": refused}) if refused else view

    def queue_history(self, queue: str) -> list[HistoryPoint]:
        with self.lock:
            return self.state.history(queue)

    def dead_jobs(self, queue: str, limit: int = 50) -> list[DeadJob]:
        with self.broker_lock:
            return self.broker.dead_jobs(queue, limit=limit)

    def requeue_dead(self, queue: str) -> int:
        with self.broker_lock:
            return self.broker.requeue_dead(queue)

    # --- JobSource (admin_ui.source): the broker calls of the job routes (api/jobs.py) ---

    def find_job(self, job_id: str) -> JobInfo | None:
        """Where the job is; a running one with the host and slot holding it."""
        from qcluster.manager.api.jobs import known_queues, placed

        queues = known_queues(self)
        found = self.job_reads.read(lambda broker: broker.job(job_id, queues=queues))
        if found is not None and found.state == "unknown":
            return self._held_by_a_slot(found)
        return None if found is None else placed(self, [found])[0]

    def _held_by_a_slot(self, unknown: JobInfo) -> JobInfo:
        """A job the broker cannot place, as the masters answer: running on the slot that
        holds it, or still unknown (waiting in its queue, or finished) with why."""
        with self.lock:
            hosts = {name: entry for name, entry in self.state.reporting_hosts(
                self.clock()).items() if entry.report.schema_version >= FINDS_JOBS_SINCE}
            wait_s = 2 * max((e.report.interval_s for e in hosts.values()), default=0) + 1
        if not hosts:
            return unknown
        try:
            found = self.holders.find(unknown.id, hosts, min(wait_s, MAX_LOOKUP_WAIT_S))
        except LookupsBusy as exc:
            raise JobReadsBusy(str(exc)) from None
        if found.host is None or found.job is None:
            asked = (f"{found.answered} of the {found.asked} reporting masters answered: "
                     "none of their slots holds it now")
            return unknown.model_copy(update={"note": f"{unknown.note} ({asked})"})
        job = found.job
        return JobInfo(id=job.id, queue=job.queue, state="running", since=job.taken_at,
                       started_at=job.taken_at, attempts=job.attempts, host=found.host,
                       slot=str(job.slot_no),
                       note=None if job.started else "taken, waiting its turn in its batch")

    def job_page(self, queue: str, state: str, offset: int, limit: int) -> JobPage:
        """A page of the queue's jobs; running ones with their host, slot and start."""
        from qcluster.manager.api.jobs import placed

        page = self.job_reads.read(
            lambda broker: broker.job_page(queue, state, offset=offset, limit=limit))
        self.job_reads.paged(queue)
        return page.model_copy(update={"jobs": placed(self, page.jobs)})

    def stop(self) -> None:
        super().stop()
        self.job_reads.close()

    def requeue_dead_jobs(self, queue: str, ids: list[str]) -> int:
        with self.broker_lock:
            return self.broker.requeue_dead(queue, ids)

    def delete_dead_jobs(self, queue: str, ids: list[str]) -> int:
        with self.broker_lock:
            return self.broker.delete_dead(queue, ids)

    def check_token(self, token: str | None) -> bool:
        return self.token_name(token) is not None

    def token_name(self, token: str | None) -> str | None:
        """The name of the token (``[tokens]`` NAME, or "token" for the unnamed one) that
        ``token`` is; None when it is none of them. Every one is compared (in constant
        time), so the answer's timing does not say which one nearly matched."""
        found = None
        for name, secret in self.tokens.items():
            if token is not None and secret and secrets.compare_digest(
                    token.encode(), secret.encode()):
                found = name
        return found

    def periodic_jobs(self) -> list[PeriodicJobView]:
        """The periodic jobs with their last and next run (the admin page), and those that
        wait for a master's declaration (``learned``)."""
        found = self.periodic.views() if self.periodic is not None else []
        return found + (self.learned.pending_views() if self.learned is not None else [])

    def broker_nodes(self) -> BrokerHealth | None:
        """The broker's nodes and each queue's node, as last read (None: not read yet)."""
        return self.watch.health

    @property
    def broker_problem(self) -> str | None:
        """Why the loop's last broker read failed; None once one succeeds (/healthz)."""
        return self.watch.problem

    def health(self) -> dict[str, str]:
        """``ok``, or ``degraded`` with the reason while the loop's last broker read failed
        (the manager still answers masters: they keep their rows)."""
        if self.watch.problem is None:
            return {"status": "ok"}
        return {"status": "degraded", "broker": self.watch.problem}
