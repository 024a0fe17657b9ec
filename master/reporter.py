"""Reporting to the manager: a HostReport every few seconds, the reply is this host's row.

Fail-static: when the manager cannot be reached the master keeps its last row and keeps
processing; the outage is logged once, and its end once. A manager that answers again but
refuses the reports (401: a token it does not take; 409: another broker) is a new reason,
logged once with its hint.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence

import httpx
import psutil

from qcluster.master.supervisor import Supervisor
from qcluster.messages import (
    MAX_FIND_JOBS,
    Assignment,
    BatchCounters,
    ClusterClaim,
    HeldJob,
    HostFacts,
    HostReport,
    QueueCounters,
    SlotInfo,
)

logger = logging.getLogger(__name__)
#: Left out of a report that answers no lookup: a manager older than job lookups through
#: the masters refuses fields it does not know.
_LOOKUP_FIELDS = {"searched", "held"}
# httpx logs every request at INFO: one line per report (every 2 s) would bury the log.
logging.getLogger("httpx").setLevel(logging.WARNING)


def build_report(sup: Supervisor, interval_s: float, generation: int,
                 cluster: ClusterClaim | None = None,
                 searched: Sequence[str] = ()) -> HostReport:
    snap = sup.snapshot
    sample = snap.sample
    now = time.time()
    mono_now = time.monotonic()
    counters = sup.counters.take()
    alive: dict[str, float] = {}
    for info in snap.slots:
        lived_s = mono_now - snap.started_mono.get(info.slot_no, mono_now)
        alive[info.queue] = alive.get(info.queue, 0.0) + max(0.0, min(interval_s, lived_s))
    queues = set(counters) | set(alive)
    pss_total = sample.pss_total_bytes if sample else 0
    facts = HostFacts(
        cpus=sample.cpus if sample else float(os.cpu_count() or 1),
        loadavg=os.getloadavg(),
        mem_total_bytes=int(psutil.virtual_memory().total),
        mem_available_bytes=sample.mem_available_bytes if sample else 0,
        pss_total_bytes=pss_total,
        avg_slot_pss_bytes=snap.avg_slot_pss_bytes,
    )
    return HostReport(
        host=sup.host_name, sent_at=now, interval_s=interval_s, facts=facts,
        capacity_slots=snap.capacity_slots,
        queues=dict(sup.reload.code.serving.policies),
        slots=snap.slots,
        counters={q: QueueCounters(counters=counters.get(q, BatchCounters()),
                                   alive_s=alive.get(q, 0.0)) for q in queues},
        generation=generation,
        code=snap.code,
        cluster=cluster,
        periodic=dict(sup.app.periodic_jobs),
        fatal={q: why[:2000] for q, why in snap.fatal.items()},
        searched=list(searched),
        held=held_jobs(sup, snap.slots, searched),
        master=this_master(),
    )


@functools.cache
def this_master() -> str:
    """This master process in words, as the manager names it when two masters report
    under one host name: its PID, its machine and when it started."""
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"pid {os.getpid()} on machine {socket.gethostname()}, started {started}"


def held_jobs(sup: Supervisor, slots: Sequence[SlotInfo], searched: Sequence[str]) -> list[HeldJob]:
    """Which of ``searched`` this host's slots hold now, each with its slot's number."""
    if not searched:
        return []
    slot_of = {info.pid: info.slot_no for info in slots}
    return [job.model_copy(update={"slot_no": slot_of[pid]})
            for pid, jobs in sup.pool.channels.held(set(searched)).items() if pid in slot_of
            for job in jobs][:MAX_FIND_JOBS]


class Reporter:
    """Runs in a daemon thread next to the supervisor loop."""

    def __init__(self, sup: Supervisor, manager_url: str, interval_s: float, *,
                 token: str | None = None, cluster: ClusterClaim | None = None) -> None:
        self.sup = sup
        self.cluster = cluster
        """The broker this master works on: a manager on another one refuses the reports."""
        self.url = manager_url.rstrip("/") + "/api/v1/reports"
        self.interval_s = interval_s
        self.headers = {"Content-Type": "application/json"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self.generation = 0
        self.reachable = True
        self.failing = ""
        """Why the reports fail now (an HTTP status, or ``unreachable``); '' while they pass."""
        self.find_jobs: list[str] = []
        """The jobs the manager's last reply asked about: every report says which of them
        this host's slots hold."""
        self._answer_now = False
        self._last_failure = ""
        self._sending = threading.Lock()
        """Held while a report is sent: no report is sent after the leave."""
        self.left = False

    def start(self) -> None:
        threading.Thread(target=self._loop, name="master-reporter", daemon=True).start()

    def _loop(self) -> None:
        with httpx.Client(timeout=5.0) as client:
            while not self.sup.stopping:
                if not self._answer_now:  # a lookup waits for this host's answer
                    time.sleep(self.interval_s)
                try:
                    self.report_once(client)
                except Exception as exc:  # a report that could not be made ends no report
                    if repr(exc) != self._last_failure:
                        logger.exception("a report to the manager could not be made")
                    self._last_failure = repr(exc)

    def report_once(self, client: httpx.Client) -> None:
        with self._sending:
            if not self.left:
                self._report(client)

    def leave(self, timeout_s: float = 2.0) -> None:
        """Tell the manager this master stopped cleanly, so that its host goes from the view
        instead of staying DEAD (and alerting) until the manager restarts. Best effort: a
        manager that does not answer in time still sees the host expire."""
        with self._sending:
            self.left = True
            base = self.url.removesuffix("/api/v1/reports")
            url = f"{base}/api/v1/hosts/{self.sup.host_name}/leave"
            try:
                httpx.post(url, headers=self.headers, timeout=timeout_s).raise_for_status()
            except httpx.HTTPError as exc:
                logger.info("could not tell the manager this host leaves (%s): it will show "
                            "it as not reporting", _said(exc))
                return
        logger.info("told the manager at %s that host %s leaves", url, self.sup.host_name)

    def _report(self, client: httpx.Client) -> None:
        self._answer_now = False
        report = build_report(self.sup, self.interval_s, self.generation, self.cluster,
                              self.find_jobs)
        try:
            response = client.post(self.url, content=report.model_dump_json(
                                       exclude=None if report.searched else _LOOKUP_FIELDS),
                                   headers=self.headers)
            response.raise_for_status()
            assignment = Assignment.model_validate_json(response.content)
        except (httpx.HTTPError, ValueError) as exc:
            # Logged once per reason: a manager restarted with a token the master lacks
            # goes from "refused connection" to 401, which only the hint explains.
            reason = _reason(exc)
            if reason != self.failing:
                what = "refused the report" if reason.isdigit() else "unreachable"
                logger.warning("manager %s %s (%s): keeping the last slot row%s",
                               self.url, what, _said(exc), _hint(exc))
            self.failing = reason
            self.reachable = False
            self._give_back(report)
            return
        if not self.reachable:
            logger.info("manager %s reachable again", self.url)
        self.reachable = True
        self.failing = ""
        self.generation = assignment.generation
        self.interval_s = assignment.report_interval_s
        self.sup.set_row(assignment.row)
        self.sup.set_reload_id(assignment.reload_id)
        self._answer_now = bool(set(assignment.find_jobs) - set(self.find_jobs))
        self.find_jobs = assignment.find_jobs

    def _give_back(self, report: HostReport) -> None:
        """Counters of an undelivered report go into the next one."""
        self.sup.counters.give_back({q: c.counters for q, c in report.counters.items()})


def _reason(exc: Exception) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        return str(exc.response.status_code)
    return "unreachable"


def _said(exc: Exception) -> str:
    """The error in one line: httpx's text for a status adds a second line with a link."""
    if isinstance(exc, httpx.HTTPStatusError):
        return f"{exc.response.status_code} {exc.response.reason_phrase}"
    return str(exc)


def _hint(exc: Exception) -> str:
    if isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code == 401:
        return " (the manager wants its token: set token / QCLUSTER_TOKEN to the manager's)"
    if isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code == 409:
        try:  # the manager works on another broker: its one line says which
            return f": REFUSED: {exc.response.json().get('detail')}"
        except (ValueError, AttributeError):
            return ""
    return ""
