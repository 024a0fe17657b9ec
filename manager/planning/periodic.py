"""The manager's ticker: enqueues each tick of each periodic job, once across managers.

A thread of its own (not the planning round: a round may take seconds and runs every
``interval_s``, up to a minute). It sleeps until the next tick of any job (at most
:data:`MAX_SLEEP_S`), then for each job computes the due ticks
(:func:`qcluster.periodic.due_ticks`, from the job's last tick recorded in the broker)
and enqueues each with ``Broker.publish_tick``: the tick's job and the record of the job's
last enqueued tick are stored as one step, refused when the record holds that tick or a
later one. A second manager started by mistake, or a restarted one, is refused the ticks
already enqueued, so no tick is enqueued twice.

The guarantee: each tick is enqueued exactly once, whatever happens to a call (a late
reply, a reset, a retry, a failover, this manager killed): the tick's job id and body
depend only on the job and the tick, a call that raised is left to the next pass, which
reads the record again and calls again if the tick is not recorded. Where a backend
cannot make this exact, docs/operations.md says what can happen ("Publishing and periodic
jobs"). If the job reached a Redis master but too few replicas confirmed it
(``ReplicationUnconfirmed``), it is enqueued and recorded (a failover before a replica
copies it may lose it, as any publish).

A record in the broker that cannot be a tick (not a number, or later than this manager's
clock allows) stops only its own job, with a warning; the lock that serialises the
broker's use is taken per tick, never for a whole pass.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from qcluster.app import App
from qcluster.broker.base import Broker
from qcluster.config import Settings
from qcluster.errors import (
    AppImportError,
    BrokerError,
    BrokerUnavailable,
    ConfigError,
    ReplicationUnconfirmed,
)
from qcluster.job import Envelope
from qcluster.manager.planning.learned_periodic import without_partial
from qcluster.periodic import (
    PeriodicJobView,
    PeriodicSpec,
    due_ticks,
    job_id,
    periodic_spec,
)

logger = logging.getLogger(__name__)

#: Longest sleep between passes: a stop, or another manager's death, is noticed this soon.
MAX_SLEEP_S = 1.0
#: Headers of an enqueued tick's job: the periodic job's name and the tick (ms since epoch).
NAME_HEADER = "qcluster-periodic"
TICK_HEADER = "qcluster-tick"


def configured_jobs(settings: Settings, app: App | None = None) -> dict[str, PeriodicSpec]:
    """``@app.periodic`` jobs, then ``[periodic.NAME]`` (its keys replace the app's for
    the same NAME). A bad spec is a one-line ConfigError naming the job and the field."""
    jobs: dict[str, PeriodicSpec] = dict(app.periodic_jobs) if app is not None else {}
    for name, fields in settings.periodic.items():
        declared = _declared_fields(jobs.get(name))
        if "cron" in fields or "every" in fields:  # the file's schedule replaces the app's
            declared.pop("cron", None)
            declared.pop("every", None)
        jobs[name] = periodic_spec(name, {**declared, **fields}, where=f"[periodic.{name}]")
    return jobs


def _declared_fields(spec: PeriodicSpec | None) -> dict[str, Any]:
    if spec is None:
        return {}
    return {key: value for key, value in spec.model_dump(exclude={"name"}).items()
            if value is not None}


def app_for_periodic(settings: Settings) -> App | None:
    """The app the settings name (``app`` / QCLUSTER_APP), for its ``@app.periodic`` jobs.
    None when none is named, or when it cannot be imported here (a manager often runs
    without the application's code): logged, and the configured jobs still run. A bad
    periodic spec in the app is a ConfigError (the manager refuses to start)."""
    if not settings.app:
        return None
    from qcluster.cli_support import load_app_checked

    try:
        # Every import failure in one line (a syntax error or an exception the module
        # raises as much as a missing module): the manager goes on without the app.
        app: App = load_app_checked(settings.app)
        return app
    except AppImportError as exc:
        logger.warning("periodic jobs of app %s are not run by this manager: %s",
                       settings.app, exc)
        return None


def ticker_for(settings: Settings, broker: Broker, broker_lock: threading.Lock,
               clock: Callable[[], float] = time.time) -> PeriodicTicker | None:
    """The manager's ticker, or None when no periodic job is declared."""
    app = app_for_periodic(settings)
    # without the app, a [periodic.NAME] changing its declaration waits for a master's report
    jobs = configured_jobs(settings if app is not None else without_partial(settings), app)
    if not jobs:
        return None
    return PeriodicTicker(jobs, broker, broker_lock, clock)


class PeriodicTicker:
    """Enqueues periodic jobs' ticks (see the module docstring)."""

    def __init__(self, jobs: dict[str, PeriodicSpec], broker: Broker,
                 broker_lock: threading.Lock, clock: Callable[[], float] = time.time) -> None:
        self.jobs = jobs
        self.broker = broker
        self.broker_lock = broker_lock
        """The manager's: a Broker is not thread-safe, and the planning loop uses it too."""
        self.clock = clock
        self.started_ms = _ms(clock())
        """Where a job no manager ever enqueued starts: no tick before this manager ran."""
        self.last: dict[str, int] = {}
        """The broker's record as last read: each job's last enqueued tick."""
        self.enqueued = 0
        """Ticks this manager enqueued (it won their claims)."""
        self._warned_future: dict[str, int] = {}
        """Each job's implausible record as last warned about (warned once, not per pass)."""
        self.stopped = threading.Event()
        self._thread: threading.Thread | None = None

    # --- one pass ---------------------------------------------------------------------

    def run_due(self) -> float:
        """Enqueue every due tick this manager wins; returns seconds until the next tick.

        The broker lock is taken per round trip group (the read, then each tick's claim and
        publish), not for the whole pass: a pass catching up many ticks must not hold the
        planning rounds and the operators' pause/drain back. A job whose pass fails (a bad
        record, a script error) is logged and the others go on; a broker that is away ends
        the pass (every job would fail the same way)."""
        now_ms = _ms(self.clock())
        with self.broker_lock:
            recorded = self.broker.last_ticks()
        self.last = {name: tick for name, tick in recorded.items()
                     if name in self.jobs and self._plausible(self.jobs[name], tick, now_ms)}
        for spec in self.jobs.values():
            if spec.name in recorded and spec.name not in self.last:
                continue  # a record from the future: warned by _plausible
            try:
                self._run_job(spec, now_ms)
            except BrokerUnavailable:
                raise
            except (BrokerError, ValueError, OverflowError) as exc:  # this job's alone
                logger.warning("periodic %s: %s (trying again)", spec.name, exc)
            except Exception:  # one job's failure must not stop the others' ticks
                logger.exception("periodic %s: pass failed (trying again)", spec.name)
        return self._seconds_to_next(_ms(self.clock()))

    def _plausible(self, spec: PeriodicSpec, tick_ms: int, now_ms: int) -> bool:
        """False (warned once per record) for a record later than any manager could have
        enqueued: past the tick after ``now + missed_after`` (clocks differ by less). Such
        a record (another program's write, a clock far ahead) would refuse every claim, or
        overflow the schedule, so the job's ticks wait and the operator is told why."""
        try:
            bound = spec.next_tick(now_ms + spec.missed_after_ms)
        except (ValueError, OverflowError):
            bound = now_ms
        if tick_ms <= bound:
            return True
        if self._warned_future.get(spec.name) != tick_ms:
            self._warned_future[spec.name] = tick_ms
            logger.warning("periodic %s: its recorded last tick (%d ms) is later than this "
                           "manager's clock allows; no tick is enqueued before it (a clock "
                           "far ahead, or another program, wrote it: remove the record to "
                           "start again)", spec.name, tick_ms)
        return False

    def _run_job(self, spec: PeriodicSpec, now_ms: int) -> None:
        last = self.last.get(spec.name)
        start = last if last is not None else self.started_ms
        due = due_ticks(spec, start, now_ms)
        edge = now_ms - spec.missed_after_ms
        if spec.next_tick(start) <= edge:
            logger.info("periodic %s: ticks after %s were missed (no manager ran); "
                        "catch_up=%s enqueues %d of them", spec.name, _when(start),
                        spec.catch_up, sum(1 for tick in due if tick <= edge))
        for tick in due:
            with self.broker_lock:
                if self._enqueue(spec, tick):
                    self.enqueued += 1
            self.last[spec.name] = max(tick, self.last.get(spec.name, tick))

    def _enqueue(self, spec: PeriodicSpec, tick_ms: int) -> bool:
        """Enqueue the tick unless it is recorded already (``Broker.publish_tick``, one
        step): True when this call enqueued it. The job's id and body depend only on the
        job and the tick, so a second call for the same tick (after a lost reply) is the
        same publish, and the broker's record refuses it. A BrokerError leaves the tick
        to the next pass, which reads the record again: never given up, never guessed.
        After ReplicationUnconfirmed the tick is enqueued and recorded on the master (a
        failover before a replica copies it may lose it, as any publish)."""
        identifier = job_id(spec.name, tick_ms)
        envelope = Envelope(id=identifier, queue=spec.queue, payload=spec.payload,
                            enqueued_at=tick_ms / 1000,
                            headers={NAME_HEADER: spec.name, TICK_HEADER: str(tick_ms)})
        try:
            stored = self.broker.publish_tick(spec.queue, spec.name, tick_ms, identifier,
                                              envelope.model_dump_json().encode())
        except ReplicationUnconfirmed:
            logger.warning("periodic %s: tick %s is enqueued on the master but no replica "
                           "confirmed it in time (a failover now could lose it)",
                           spec.name, _when(tick_ms))
            return True
        logger.debug("periodic %s: tick %s %s %s", spec.name, _when(tick_ms),
                     "enqueued to" if stored else "was enqueued already to", spec.queue)
        return stored

    def _seconds_to_next(self, now_ms: int) -> float:
        next_ms = min(spec.next_tick(now_ms) for spec in self.jobs.values())
        return max(0.0, (next_ms - now_ms) / 1000)

    # --- what the admin page shows -----------------------------------------------------

    def views(self) -> list[PeriodicJobView]:
        """Each job with its last enqueued tick (as last read) and its next tick."""
        now_ms = _ms(self.clock())
        found = []
        for name, spec in sorted(self.jobs.items()):
            last = self.last.get(name)
            found.append(PeriodicJobView(
                name=name, queue=spec.queue, schedule=spec.schedule,
                catch_up=str(spec.catch_up),
                last_run=last / 1000 if last is not None else None,
                next_run=spec.next_tick(max(now_ms, last or 0)) / 1000,
            ))
        return found

    # --- the thread ---------------------------------------------------------------------

    def loop(self) -> None:
        while not self.stopped.is_set():
            try:
                wait_s = self.run_due()
            except (BrokerError, ConfigError) as exc:
                logger.warning("periodic jobs: %s (trying again)", exc)
                wait_s = MAX_SLEEP_S
            except Exception:  # the ticker must outlive one bad pass
                logger.exception("periodic jobs: pass failed")
                wait_s = MAX_SLEEP_S
            self.stopped.wait(min(max(wait_s, 0.001), MAX_SLEEP_S))

    def start(self) -> None:
        if self._thread is None:
            logger.info("periodic jobs: %s", ", ".join(
                f"{s.name} ({s.schedule} -> {s.queue})" for s in self.jobs.values()))
            self._thread = threading.Thread(target=self.loop, name="manager-periodic",
                                            daemon=True)
            self._thread.start()

    def stop(self, wait_s: float = 10.0) -> None:
        self.stopped.set()
        if self._thread is not None:
            self._thread.join(wait_s)


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


def _when(tick_ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(tick_ms / 1000))
