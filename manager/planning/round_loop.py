"""The manager's planning loop: one round every ``interval_s``, in a daemon thread::

    observe   the controls (pause, drain) and broker stats (under the broker lock),
              then a copy of the state's reports and counters (taken under the state
              lock, read after it): a RoundInput
    decide    manager.planning.rounds.decide: plan and place, pure, outside any lock
    act       publish the slot map (the next replies carry it), log the decisions,
              add the history points (their rates counted outside the lock), write the
              recording

then the running rollout, if any, moves on. :class:`RoundLoop` holds the state, the broker,
their two locks and the collaborators that share them: ``ControlDesk`` (pause and drain,
``manager/controls/desk.py``), ``ReloadDriver`` (rolling reloads, ``manager/reloads/driver.py``)
and ``BrokerWatch`` (the loop's broker reads and what /healthz says,
``manager/broker_watch.py``). The service (``manager/service.py``) adds the commands and
reads the routes call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from qcluster.broker.base import Broker
from qcluster.manager.broker_watch import BrokerWatch
from qcluster.manager.controls.desk import ControlDesk
from qcluster.manager.controls.store import ControlStore
from qcluster.manager.planning.periodic import PeriodicTicker, ticker_for
from qcluster.manager.planning.recorder import Recorder
from qcluster.manager.planning.rounds import RoundInput, RoundResult, decide, next_ticks, with_ticks
from qcluster.manager.reloads.driver import ReloadDriver
from qcluster.manager.state import ClusterState

logger = logging.getLogger(__name__)
#: How long ``stop`` waits for a round in progress (a broker call has its own timeouts).
STOP_WAIT_S = 10.0


class RoundLoop:
    """The round (observe -> decide -> act) and the thread that runs it; the FastAPI
    lifespan calls ``start`` and ``stop``."""

    def __init__(self, state: ClusterState, broker: Broker,
                 clock: Callable[[], float] = time.time,
                 recorder: Recorder | None = None) -> None:
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
        self._thread: threading.Thread | None = None
        now = self._now  # the collaborators follow a clock set after construction
        self.watch = BrokerWatch(state, broker, self.lock, self.broker_lock, now)
        self.desk = ControlDesk(state, ControlStore(broker), self.lock, self.broker_lock, now)
        self.reloads = ReloadDriver(state, self.lock, now)
        self.periodic: PeriodicTicker | None = ticker_for(state.settings, broker,
                                                          self.broker_lock, clock)
        """Enqueues the periodic jobs' ticks (its own thread); None: none is declared."""

    def _now(self) -> float:
        return self.clock()

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
        stats = self.watch.stats()
        now = self.clock()  # the broker's counts are as of now (the arrivals depend on it)
        self.watch.follow()
        with self.lock:
            self.state.set_stats(stats)
            self.state.prune(now)
            self.state.count_arrivals(now)
            frozen = self.state.frozen()
        # Read from the copy, outside the lock: the reports are answered meanwhile.
        return with_ticks(frozen.round_input(now), self.next_ticks(now))

    def next_ticks(self, now: float) -> dict[str, float]:
        """Seconds from ``now`` to each queue's next periodic tick, from the schedules this
        manager enqueues (the planner pre-warms a slot for it)."""
        return next_ticks(self.periodic.jobs.values(), now) if self.periodic is not None else {}

    def act(self, result: RoundResult) -> None:
        """Publish the plan, log the decisions, write the recording."""
        with self.lock:
            frozen = self.state.frozen()
        # Computed outside the lock from the copy: the lock is held to publish, not to count.
        rates = frozen.rates_out(result.plans, result.now)
        observation = (frozen.observation(self.recorder.last_round_at, result.now)
                       if self.recorder is not None else None)
        with self.lock:
            self.state.apply(result, rates)
        for decision in result.decisions:
            logger.info("decision: %s", decision.reason)
        if self.recorder is not None and observation is not None:
            self.recorder.write(observation, result.now)

    def read_controls(self) -> None:
        """The broker's controls replace the state's (a restart, or a second manager's
        change, is seen within a round); a failed read keeps the ones held."""
        self.desk.read()

    def advance_reload(self) -> None:
        """Move the running rollout on from the hosts' last reports (every round)."""
        self.reloads.advance()

    def check_broker(self) -> None:
        """Store the broker's durability notes, the queues holding jobs that no live
        host's app declares and the nodes' health, for the overview page."""
        self.watch.check()

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
