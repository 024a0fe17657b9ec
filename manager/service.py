"""The manager's service: the state, the broker and the planning loop behind one lock.

The HTTP routes (``manager/api.py``) and the admin pages only call its methods. Every
``interval_s`` the loop runs one round::

    observe   the controls (pause, drain) and broker stats (under the broker lock),
              then the state's reports and counters (under the state lock): a RoundInput
    decide    manager.rounds.decide: plan and place, pure, outside any lock
    act       publish the slot map (the next replies carry it), log the decisions,
              add the history points, write the recording

Started and stopped by the FastAPI lifespan (``create_app``).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from qcluster.broker.base import Broker, DeadJob, QueueStats
from qcluster.broker.health import BrokerHealth, read_health
from qcluster.controls import UNNAMED_TOKEN, Control, ControlKind
from qcluster.errors import BrokerError, ConfigError
from qcluster.manager.controls import ControlStore
from qcluster.manager.periodic import PeriodicJobView, PeriodicTicker, ticker_for
from qcluster.manager.recorder import Recorder
from qcluster.manager.reloads import TAKE_UP_S, Rollout, advance, start
from qcluster.manager.rounds import RoundInput, RoundResult, decide
from qcluster.manager.state import ClusterState
from qcluster.manager.views import cluster_view
from qcluster.messages import (
    Assignment,
    ClusterView,
    HistoryPoint,
    HostReport,
    UndeclaredQueueView,
)

logger = logging.getLogger(__name__)
#: How often the planning loop re-reads the broker's durability and its undeclared queues:
#: a round trip per broker queue, not worth paying every round or on every page load.
BROKER_CHECK_INTERVAL_S = 60.0
#: How long ``stop`` waits for a round in progress (a broker call has its own timeouts).
STOP_WAIT_S = 10.0


class ReloadRefused(ValueError):
    """A reload request the manager does not start: ``status`` is the HTTP answer (404 an
    unknown host, 409 a rollout already running or nobody to reload)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ManagerService:
    """What the API, the admin UI and the loop work on.

    Implements admin_ui.source.ClusterSource.
    """

    def __init__(self, state: ClusterState, broker: Broker, token: str | None,
                 clock: Callable[[], float] = time.time,
                 recorder: Recorder | None = None,
                 tokens: dict[str, str] | None = None) -> None:
        self.state = state
        self.broker = broker
        self.clock = clock
        self.recorder = recorder
        """``--record``: writes what each round observed."""
        self.lock = threading.RLock()
        """The state's: the HTTP handlers and the loop share it."""
        self.broker_lock = threading.Lock()
        self.stopped = threading.Event()
        self.last_round_s = 0.0
        self.next_broker_check = 0.0
        self.warned_undeclared: set[str] = set()
        self.listed_queues: set[str] = set()
        """The broker's queues at the last check (see watch_undeclared)."""
        self.broker_problem: str | None = None
        """Why the loop's last broker read failed; None once one succeeds (/healthz)."""
        self.broker_health: BrokerHealth | None = None
        """Per-node broker health (qcluster.broker.health), read at each broker check and
        every round while broker reads fail (and once after they recover)."""
        self._health_stale = False
        self._thread: threading.Thread | None = None
        self.periodic: PeriodicTicker | None = ticker_for(state.settings, broker,
                                                          self.broker_lock, clock)
        """Enqueues the periodic jobs' ticks (its own thread); None: none is declared."""
        self.control_store = ControlStore(broker)
        """Pause and drain, kept in the broker (``manager/controls.py``)."""
        self.take_up_s = TAKE_UP_S
        """Seconds a host asked to reload has to show the id before it is skipped."""
        self.tokens: dict[str, str] = dict(state.settings.tokens if tokens is None else tokens)
        """Token name -> secret: ``[tokens]`` and the unnamed ``token`` (named "token")."""
        if token:
            self.tokens[UNNAMED_TOKEN] = token

    # --- commands: the routes' and the masters' ------------------------------------

    def receive(self, report: HostReport) -> Assignment:
        """A master's report; the reply is its row of the slot map."""
        with self.lock:
            return self.state.receive(report, self.clock())

    def pause(self, queue: str, by: str = UNNAMED_TOKEN) -> Control:
        """Plan no slot for the queue until it is resumed (from the next round); kept in
        the broker, so a restarted manager keeps it. Raises BrokerError when the broker
        cannot store it (nothing changes then)."""
        return self._set_control("pause", queue, by)

    def resume(self, queue: str) -> None:
        self._clear_control("pause", queue)

    def drain(self, host: str, by: str = UNNAMED_TOKEN) -> Control:
        """Plan no slot on the host until it is undrained: its next reply is an empty
        row, and the next round places its slots on the others. Kept in the broker."""
        return self._set_control("drain", host, by)

    def undrain(self, host: str) -> None:
        self._clear_control("drain", host)

    def reload(self, host: str | None, by: str = UNNAMED_TOKEN) -> dict[str, Any]:
        """Start a rolling reload of ``host``, or of every reporting host (None) one at a
        time by name; the first host is asked at once (its next reply carries the id).
        Returns the rollout (``reload_status``). Raises ReloadRefused: 404 an unknown host,
        409 a rollout already running, the host not reporting, or no host reporting."""
        with self.lock:
            now = self.clock()
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
            rollout = start(f"r{secrets.token_hex(6)}", by, hosts, now)
            logger.info("reload %s of %s asked by %s", rollout.id, ", ".join(hosts), by)
            return self._advance(rollout, now).view()

    def reload_status(self) -> dict[str, Any] | None:
        """The rollout running, or the last one (None: none since the manager started)."""
        with self.lock:
            rollout = self.state.reloads.rollout
            return rollout.view() if rollout is not None else None

    def advance_reload(self) -> None:
        """Move the running rollout on from the hosts' last reports (every round)."""
        with self.lock:
            rollout = self.state.reloads.rollout
            if rollout is not None and rollout.running:
                self._advance(rollout, self.clock())

    def _advance(self, rollout: Rollout, now: float) -> Rollout:
        """(caller holds the lock)"""
        advanced = advance(rollout, self.state.hosts_seen(now), now, self.take_up_s)
        self.state.apply_reload(advanced, now)
        for reason in advanced.reasons:
            logger.info("decision: %s", reason)
        return advanced.rollout

    def controls(self) -> list[Control]:
        """The pauses and drains in force, with who set them and when (by kind, name)."""
        with self.lock:
            return sorted(self.state.controls.values(), key=lambda c: (c.kind, c.name))

    def _set_control(self, kind: ControlKind, name: str, by: str) -> Control:
        control = Control(kind=kind, name=name, by=by, at=self.clock())
        with self.broker_lock:  # held while the state follows: a round's read cannot interleave
            self.control_store.set(control)
            with self.lock:
                self.state.add_control(control)
        logger.info("%s %s by %s", kind, name, by)
        return control

    def _clear_control(self, kind: ControlKind, name: str) -> None:
        with self.broker_lock:
            self.control_store.clear(kind, name)
            with self.lock:
                self.state.remove_control(kind, name)
        logger.info("%s %s", "resume" if kind == "pause" else "undrain", name)

    def read_controls(self) -> None:
        """The broker's controls replace the state's (a restart, or a second manager's
        change, is seen within a round); a failed read keeps the ones held."""
        with self.broker_lock:
            try:
                controls = self.control_store.read()
            except BrokerError as exc:
                logger.warning("reading the controls failed: %s", exc)
                return
            if controls is not None:
                with self.lock:
                    self.state.set_controls(controls)

    # --- ClusterSource -------------------------------------------------------------

    def cluster_view(self) -> ClusterView:
        with self.lock:
            snapshot = self.state.snapshot(self.clock())
        return cluster_view(snapshot)

    def queue_history(self, queue: str) -> list[HistoryPoint]:
        with self.lock:
            return self.state.history(queue)

    def dead_jobs(self, queue: str, limit: int = 50) -> list[DeadJob]:
        with self.broker_lock:
            return self.broker.dead_jobs(queue, limit=limit)

    def requeue_dead(self, queue: str) -> int:
        with self.broker_lock:
            return self.broker.requeue_dead(queue)

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
        """The periodic jobs with their last and next run (the admin page)."""
        return self.periodic.views() if self.periodic is not None else []

    def broker_nodes(self) -> BrokerHealth | None:
        """The broker's nodes and each queue's node, as last read (None: not read yet)."""
        return self.broker_health

    def health(self) -> dict[str, str]:
        """``ok``, or ``degraded`` with the reason while the loop's last broker read failed
        (the manager still answers masters: they keep their rows)."""
        if self.broker_problem is None:
            return {"status": "ok"}
        return {"status": "degraded", "broker": self.broker_problem}

    # --- the round: observe -> decide -> act ---------------------------------------

    def round(self) -> None:
        started = time.perf_counter()
        self.act(decide(self.observe()))
        self.advance_reload()
        self.last_round_s = time.perf_counter() - started

    def observe(self) -> RoundInput:
        """Broker stats for every known queue, then the state at ``now``; drops the
        samples older than the window and counts the jobs arrived since the last round."""
        self.read_controls()
        stats = self._broker_stats()
        now = self.clock()  # the broker's counts are as of now (the arrivals depend on it)
        if time.monotonic() >= self.next_broker_check:
            self.check_broker()
        else:
            self.watch_undeclared()
            if self.broker_problem is not None or self._health_stale:
                self.read_broker_health()  # a node down or failing over: follow it
        with self.lock:
            self.state.set_stats(stats)
            self.state.prune(now)
            self.state.count_arrivals(now)
            return self.state.round_input(now)

    def act(self, result: RoundResult) -> None:
        """Publish the plan, log the decisions, write the recording."""
        with self.lock:
            self.state.apply(result)
            observation = (self.state.observation(self.recorder.last_round_at, result.now)
                           if self.recorder is not None else None)
        for decision in result.decisions:
            logger.info("decision: %s", decision.reason)
        if self.recorder is not None and observation is not None:
            self.recorder.write(observation, result.now)

    def _broker_stats(self) -> dict[str, QueueStats]:
        with self.lock:
            queues = list(self.state.policies(self.clock()))
        stats = {}
        with self.broker_lock:
            # One failed read makes the round's verdict: on a Redis Cluster the other
            # shards answer, and a later queue's success must not hide a dead shard.
            failed: BrokerError | None = None
            for queue in queues:
                try:
                    stats[queue] = self.broker.stats(queue)
                except BrokerError as exc:
                    logger.warning("broker stats for %s failed: %s", queue, exc)
                    failed = failed or exc
            if queues:
                self._broker_read(failed)
            elif self.broker_problem is not None:
                try:  # nothing to read this round: is the broker back?
                    self.broker.ping()
                    self._broker_read()
                except BrokerError as exc:
                    self._broker_read(exc)
        return stats

    def _broker_read(self, error: BrokerError | None = None) -> None:
        """Note how a broker read of the loop ended (what /healthz says)."""
        if error is None:
            if self.broker_problem is not None:
                logger.info("broker answers again")
            self.broker_problem = None
        else:
            lines = str(error).strip().splitlines() or [type(error).__name__]
            self.broker_problem = lines[0][:200]

    def check_broker(self) -> None:
        """Store the broker's durability notes and the queues holding jobs that no live
        host's app declares (warned once each in the log) for the overview page."""
        self.next_broker_check = time.monotonic() + BROKER_CHECK_INTERVAL_S
        with self.lock:
            declared = set(self.state.policies(self.clock()))
        undeclared: list[UndeclaredQueueView] | None = None  # None: keep the last known
        with self.broker_lock:
            try:
                durability = self.broker.durability()
            except (BrokerError, ConfigError) as exc:
                durability = [str(exc)]
            try:
                undeclared = self._undeclared(declared)
                self._broker_read()
            except BrokerError as exc:
                logger.warning("broker queue listing failed: %s", exc)
                self._broker_read(exc)
        self._warn_undeclared(undeclared)
        with self.lock:
            self.state.set_broker_warnings(undeclared=undeclared, durability=durability)
        self.read_broker_health()

    def read_broker_health(self) -> None:
        """Read each broker node's health and the node of each declared queue (one
        CLUSTER NODES and a PING per node on a Redis Cluster: see qcluster.broker.health)."""
        self._health_stale = self.broker_problem is not None
        with self.lock:
            declared = list(self.state.policies(self.clock()))
        try:
            with self.broker_lock:
                self.broker_health = read_health(self.broker, declared, self.clock,
                                                 known_problem=self.broker_problem)
        except Exception:  # the page's table must not stop a round
            logger.exception("reading the broker's node health failed")

    def watch_undeclared(self) -> None:
        """Every round between two broker checks (B3): a queue the broker did not list
        before, outside the declared ones, and each queue already shown as undeclared is
        read again, so an enqueue to a queue no app declares shows at the next round with
        its current count, not after BROKER_CHECK_INTERVAL_S. While there is nothing to
        show this costs one listing a round (Redis: one SMEMBERS)."""
        if getattr(self.broker, "cluster", False):
            return  # a Redis Cluster lists its queues by scanning every master: 60 s it is
        with self.lock:
            declared = set(self.state.policies(self.clock()))
            listed = list(self.state.undeclared)
        shown = [q for q in listed if q.name not in declared]  # an app declares the others now
        with self.broker_lock:
            try:
                names = set(self.broker.queues()) - declared
                again = (names - self.listed_queues) | {q.name for q in shown}
                if not again and len(shown) == len(listed):
                    return
                fresh = self._read_undeclared(again)
            except BrokerError as exc:
                self._broker_read(exc)
                return
        self.listed_queues |= names
        self._warn_undeclared(fresh)  # every shown queue was read again: fresh is the list
        with self.lock:
            self.state.set_broker_warnings(undeclared=fresh)

    def _read_undeclared(self, queues: set[str]) -> list[UndeclaredQueueView]:
        """Those of ``queues`` holding ready or delayed jobs (caller holds broker_lock)."""
        found = []
        for queue in sorted(queues):
            stats = self.broker.stats(queue)
            if stats.ready or stats.delayed:
                found.append(UndeclaredQueueView(name=queue, ready=stats.ready,
                                                 delayed=stats.delayed))
        return found

    def _undeclared(self, declared: set[str]) -> list[UndeclaredQueueView]:
        """Broker queues outside ``declared`` with ready or delayed jobs (caller holds the lock)."""
        names = set(self.broker.queues())
        self.listed_queues = names  # watch_undeclared reads only what is new, until the next
        return self._read_undeclared(names - declared)

    def _warn_undeclared(self, undeclared: list[UndeclaredQueueView] | None) -> None:
        for queue in undeclared or []:
            if queue.name not in self.warned_undeclared:
                logger.warning("queue %s holds %d jobs but no app declares it: they wait "
                               "until one does", queue.name, queue.ready + queue.delayed)
        if undeclared is not None:
            self.warned_undeclared = {q.name for q in undeclared}

    # --- lifecycle -------------------------------------------------------------------

    def loop(self) -> None:
        interval = self.state.cfg.interval_s
        while not self.stopped.wait(interval):
            try:
                self.round()
            except Exception:  # the loop must outlive one bad round
                logger.exception("planning round failed")

    def start(self) -> None:
        """Read the broker's warnings once, then run the loop in a daemon thread."""
        if self._thread is not None:
            return
        try:
            self.read_controls()  # before the first reply: a drained host gets its empty row
        except Exception:  # the loop reads them again each round
            logger.exception("reading the controls failed")
        try:
            self.check_broker()
        except Exception:  # a warning for the page must not stop the manager
            logger.exception("broker check failed")
        self._thread = threading.Thread(target=self.loop, name="manager-planner", daemon=True)
        self._thread.start()
        if self.periodic is not None:
            self.periodic.start()

    def stop(self) -> None:
        """End the loop (a round in progress finishes first), then close the recording.
        Idempotent."""
        self.stopped.set()
        if self.periodic is not None:
            self.periodic.stop()
        thread = self._thread
        if thread is not None:
            thread.join(STOP_WAIT_S)
            if thread.is_alive():
                logger.warning("planning round still running after %.0f s", STOP_WAIT_S)
                return  # the recorder is still in use: the process exit closes it
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None
