"""What the planning loop reads from the broker besides the controls, and what it makes of
a failed read.

Every round: each known queue's stats (the round's input), and the queues that appeared
outside the declared ones. Every ``BROKER_CHECK_INTERVAL_S``: the broker's durability, every
queue holding jobs that no live host's app declares, and each node's health. Whether the
last read failed is what ``/healthz`` says.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from qcluster.broker.base import Broker, QueueStats
from qcluster.broker.health import BrokerHealth, read_health
from qcluster.errors import BrokerError, ConfigError
from qcluster.manager.state import ClusterState
from qcluster.messages import UndeclaredQueueView

#: The service's name in the log, as before the service was split.
logger = logging.getLogger(__name__)
#: How often the planning loop re-reads the broker's durability and its undeclared queues:
#: a round trip per broker queue, not worth paying every round or on every page load.
BROKER_CHECK_INTERVAL_S = 60.0


class BrokerWatch:
    """The loop's broker reads (under the broker lock), stored in the state (under its lock)."""

    def __init__(self, state: ClusterState, broker: Broker, lock: threading.RLock,
                 broker_lock: threading.Lock, clock: Callable[[], float]) -> None:
        self.state = state
        self.broker = broker
        self.lock = lock
        """The service's state lock."""
        self.broker_lock = broker_lock
        self.clock = clock
        self.next_check = 0.0
        """``time.monotonic()`` of the next full check (``check``)."""
        self.problem: str | None = None
        """Why the loop's last broker read failed; None once one succeeds (/healthz)."""
        self.health: BrokerHealth | None = None
        """Per-node broker health (qcluster.broker.health), read at each broker check and
        every round while broker reads fail (and once after they recover)."""
        self._health_stale = False
        self.undeclared = UndeclaredQueues(broker)

    def stats(self) -> dict[str, QueueStats]:
        """Every known queue's stats (a queue no live host serves too: the page and /metrics
        keep its backlog); a failed read leaves the queue out."""
        with self.lock:
            queues = list(self.state.policies())
        stats = {}
        with self.broker_lock:
            # One failed read makes the round's verdict: on a Redis Cluster the other
            # shards answer, and a later queue's success must not hide a dead shard.
            failed: BrokerError | None = None
            for index, queue in enumerate(queues):
                try:
                    stats[queue] = self.broker.stats(queue)
                except BrokerError as exc:
                    logger.warning("broker stats for %s failed: %s", queue, exc)
                    if failed is None:
                        self.note_read(exc)  # /healthz now, not after the other queues
                    failed = failed or exc
                    # Each read of a broker that is down waits for its connection retries
                    # (seconds): with 150 queues the round took many minutes. A broker
                    # that answers a ping has only this queue's node down: read the rest.
                    if index + 1 < len(queues) and not self._answers():
                        logger.warning("the broker does not answer: %d more queue(s) not "
                                       "read this round", len(queues) - index - 1)
                        break
            if queues:
                self.note_read(failed)
            elif self.problem is not None:
                try:  # nothing to read this round: is the broker back?
                    self.broker.ping()
                    self.note_read()
                except BrokerError as exc:
                    self.note_read(exc)
        return stats

    def _answers(self) -> bool:
        try:
            self.broker.ping()
        except BrokerError:
            return False
        return True

    def follow(self) -> None:
        """The round's warnings: the full check when it is due; otherwise the queues that
        appeared, and the nodes' health while a read fails (a node down or failing over)."""
        if time.monotonic() >= self.next_check:
            self.check()
        else:
            self.watch_undeclared()
            if self.problem is not None or self._health_stale:
                self.read_health()

    def note_read(self, error: BrokerError | None = None) -> None:
        """Note how a broker read of the loop ended (what /healthz says)."""
        if error is None:
            if self.problem is not None:
                logger.info("broker answers again")
            self.problem = None
        else:
            lines = str(error).strip().splitlines() or [type(error).__name__]
            self.problem = lines[0][:200]

    def check(self) -> None:
        """Store the broker's durability notes and the queues holding jobs that no live
        host's app declares (warned once each in the log) for the overview page."""
        self.next_check = time.monotonic() + BROKER_CHECK_INTERVAL_S
        declared = self._declared()
        undeclared: list[UndeclaredQueueView] | None = None  # None: keep the last known
        with self.broker_lock:
            try:
                durability = self.broker.durability()
            except (BrokerError, ConfigError) as exc:
                durability = [str(exc)]
            try:
                undeclared = self.undeclared.list_all(declared)
                self.note_read()
            except BrokerError as exc:
                logger.warning("broker queue listing failed: %s", exc)
                self.note_read(exc)
        # Before any master reported, every queue looks undeclared: no warning yet.
        self.undeclared.warn(undeclared if declared else None)
        with self.lock:
            self.state.set_broker_warnings(undeclared=undeclared, durability=durability)
        self.read_health()

    def read_health(self) -> None:
        """Read each broker node's health and the node of each declared queue (one
        CLUSTER NODES and a PING per node on a Redis Cluster: see qcluster.broker.health)."""
        self._health_stale = self.problem is not None
        with self.lock:
            declared = list(self.state.policies(self.clock()))
        try:
            with self.broker_lock:
                self.health = read_health(self.broker, declared, self.clock,
                                          known_problem=self.problem)
        except Exception:  # the page's table must not stop a round
            logger.exception("reading the broker's node health failed")

    def watch_undeclared(self) -> None:
        """Every round between two broker checks (B3): a queue the broker did not list
        before, outside the declared ones, and each queue already shown as undeclared is
        read again, so an enqueue to a queue no app declares shows at the next round with
        its current count, not after BROKER_CHECK_INTERVAL_S. While there is nothing to
        show this costs one listing a round (Redis: one SMEMBERS)."""
        if self.broker.kind() == "redis-cluster":
            return  # a Redis Cluster lists its queues by scanning every master: 60 s it is
        with self.lock:
            declared = set(self.state.policies(self.clock()))
            listed = list(self.state.undeclared)
        shown = [q for q in listed if q.name not in declared]  # an app declares the others now
        with self.broker_lock:
            try:
                fresh = self.undeclared.read_again(declared, shown, len(listed))
            except BrokerError as exc:
                self.note_read(exc)
                return
        if fresh is None:
            return
        # (every shown queue was read again: fresh is the list; none before masters report)
        self.undeclared.warn(fresh if declared else None)
        with self.lock:
            self.state.set_broker_warnings(undeclared=fresh)

    def _declared(self) -> set[str]:
        with self.lock:
            return set(self.state.policies(self.clock()))


class UndeclaredQueues:
    """The broker's queues outside the declared ones that hold jobs (they wait until an app
    declares them). Callers hold the broker lock; a broker call may raise BrokerError."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.warned: set[str] = set()
        self.listed: set[str] = set()
        """The broker's queues at the last check (``read_again`` reads only what is new)."""

    def list_all(self, declared: set[str]) -> list[UndeclaredQueueView]:
        """Broker queues outside ``declared`` with ready or delayed jobs."""
        names = set(self.broker.queues())
        self.listed = names
        return self._read(names - declared)

    def read_again(self, declared: set[str], shown: list[UndeclaredQueueView],
                   listed: int) -> list[UndeclaredQueueView] | None:
        """The queues listed since the last check and the ``shown`` ones, read again; None:
        nothing new and none of the ``listed`` shown ones became declared."""
        names = set(self.broker.queues()) - declared
        again = (names - self.listed) | {q.name for q in shown}
        if not again and len(shown) == listed:
            return None
        fresh = self._read(again)
        self.listed |= names
        return fresh

    def _read(self, queues: set[str]) -> list[UndeclaredQueueView]:
        """Those of ``queues`` holding ready or delayed jobs."""
        found = []
        for queue in sorted(queues):
            stats = self.broker.stats(queue)
            if stats.ready or stats.delayed:
                found.append(UndeclaredQueueView(name=queue, ready=stats.ready,
                                                 delayed=stats.delayed))
        return found

    def warn(self, undeclared: list[UndeclaredQueueView] | None) -> None:
        """Log each queue once, when it first shows (None: the listing failed)."""
        for queue in undeclared or []:
            if queue.name not in self.warned:
                logger.warning("queue %s holds %d jobs but no app declares it: they wait "
                               "until one does", queue.name, queue.ready + queue.delayed)
        if undeclared is not None:
            self.warned = {q.name for q in undeclared}
