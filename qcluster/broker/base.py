"""The queue-server contract every backend implements (shared/DESIGN.md section 2).

Guarantee: at-least-once. A job disappears only through ``ack`` (settled as done)
or ``dead``. A slot that dies leaves its jobs locked; they come back when the lock
expires (Redis) or when the connection closes (RabbitMQ).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from qcluster.broker.urls import BrokerUrl, parse_broker_url
from qcluster.broker.urls import mask_url as mask_url  # where the backends import it from
from qcluster.errors import ConfigError
from qcluster.failures import JobError
from qcluster.job import Delivery
from qcluster.jobs import JobInfo, JobPage
from qcluster.policy import (
    DEFAULT_DEAD_MAX_AGE,
    DEFAULT_DEAD_MAX_COUNT,
    DEFAULT_KEEP_FINISHED_S,
    MAX_DEAD_AGE_S,
    MAX_DEAD_COUNT,
    MAX_KEEP_FINISHED_S,
    MIN_DEAD_AGE_S,
    QueuePolicy,
)

#: How long a short-lived caller (a ``qcluster`` command such as ``stats`` or ``enqueue``,
#: a :class:`~qcluster.client.Client`) goes on retrying a broker that refuses or drops its
#: connections before the call raises BrokerUnavailable: a wrong port or a stopped broker
#: is said in seconds, while a connection the broker closed (it restarted) is still
#: opened again. A broker that accepts but does not answer (frozen, or a host that drops
#: packets) is given one connect or reply timeout as well (5 s by default). Long-lived
#: processes (slots, masters, the manager) keep retrying with backoff, then pause and try
#: again: they ride out a broker's restart. docs/operations.md, "When the broker does not
#: answer".
SHORT_LIVED_GIVE_UP_S = 2.0
#: What BrokerUnavailable's one line tells the user to check, after the URL and the reason.
UNREACHABLE_HINT = "is it running, and are the URL's host and port right?"


def unreachable(broker: str, safe_url: str, reason: object) -> str:
    """BrokerUnavailable's one line: ``Redis at URL unreachable: why (what to check)``."""
    return f"{broker} at {safe_url} unreachable: {str(reason).rstrip('.')} ({UNREACHABLE_HINT})"

#: A queue's ``max_attempts`` when its policy does not say.
DEFAULT_MAX_ATTEMPTS: int = QueuePolicy.model_fields["max_attempts"].default


class QueueStats(BaseModel):
    """Counts for one queue. ``ready`` counts jobs a take could return now."""

    model_config = ConfigDict(frozen=True)

    ready: int = 0
    locked: int = 0
    delayed: int = 0
    dead: int = 0

    @property
    def backlog(self) -> int:
        return self.ready


class DeadJob(BaseModel):
    """A dead-lettered job as shown to operators."""

    model_config = ConfigDict(frozen=True)

    id: str
    queue: str
    body: str
    """The stored message, decoded as UTF-8 with replacement (it may be malformed)."""
    reason: str
    attempts: int
    dead_at: float
    """Broker-clock unix seconds."""
    error: JobError | None = None
    """The last error the job raised (None: it never raised, e.g. ``job.fail``)."""


@dataclass(frozen=True, slots=True)
class DeadRetention:
    """How many dead letters a queue keeps and for how long: its policy's
    ``dead_max_count`` and ``dead_max_age`` (seconds). Applied by the broker when the
    queue's jobs are dead-lettered."""

    max_count: int = DEFAULT_DEAD_MAX_COUNT
    max_age_s: float = DEFAULT_DEAD_MAX_AGE
    keep_finished_s: float = DEFAULT_KEEP_FINISHED_S
    """And how long the queue's finished-job records are kept (its policy's
    ``keep_finished_s``; 0: none), where the backend keeps them (Redis)."""

    def __post_init__(self) -> None:
        count, age = self.max_count, self.max_age_s
        if isinstance(count, bool) or not isinstance(count, int) or not (
                1 <= count <= MAX_DEAD_COUNT):
            raise ValueError(f"dead_max_count {count!r}: want a whole number from 1 to "
                             f"{MAX_DEAD_COUNT:,}")
        if isinstance(age, bool) or not isinstance(age, int | float) or not (
                MIN_DEAD_AGE_S <= age <= MAX_DEAD_AGE_S):  # NaN fails every comparison
            raise ValueError(f"dead_max_age {age!r}: want seconds from {MIN_DEAD_AGE_S:g} "
                             f"to {MAX_DEAD_AGE_S:g} (365 days)")
        keep = self.keep_finished_s
        if isinstance(keep, bool) or not isinstance(keep, int | float) or not (
                0 <= keep <= MAX_KEEP_FINISHED_S):
            raise ValueError(f"keep_finished_s {keep!r}: want seconds from 0 to "
                             f"{MAX_KEEP_FINISHED_S:g} (7 days)")

    @property
    def max_age_ms(self) -> int:
        return round(self.max_age_s * 1000)


@dataclass(slots=True)
class Settlement:
    """What happened to each job of a batch; settled in as few round trips as possible.

    A plain dataclass: it is built once per batch on the hot path.
    """

    ack: list[Delivery] = field(default_factory=list)
    postpone: list[tuple[Delivery, float]] = field(default_factory=list)
    """Each with its delay in seconds."""
    dead: list[tuple[Delivery, str]] = field(default_factory=list)
    """Each with its reason."""
    release: list[Delivery] = field(default_factory=list)
    """Jobs given back UNSTARTED (read ahead, never handed to a handler): unlocked and
    ready again at once, with their attempts unchanged (no attempt is charged)."""
    crashed: list[Delivery] = field(default_factory=list)
    """Jobs whose slot died while running them (given back by its master, see
    :attr:`Broker.settles_for_others`): the attempt is counted, the job is marked
    suspect (run alone next time) and is ready again at once."""
    ack_held: list[Delivery] = field(default_factory=list)
    """Acked only while the lock they were taken with is still held: a master settling
    the finished jobs of a slot that died (after a lock expiry another slot may be
    running the job: it settles it itself)."""
    refused: list[tuple[Delivery, str]] = field(default_factory=list)
    """Dead-lettered without running, each with its reason: the take that found it was
    not an attempt (a job taken more often than ``max_attempts`` because its slots died
    on it), so its dead letter counts only the attempts that ran."""
    errors: dict[str, JobError] = field(default_factory=dict)
    """The last error of postponed or dead-lettered jobs, by job id: stored with the job
    (replacing any earlier one) so that lookups and dead letters show it."""
    retention: DeadRetention | None = None
    """The queue's dead-letter retention (the slot passes its policy's); None: the
    broker's own default (10,000 letters, 14 days)."""

    def __len__(self) -> int:
        return (len(self.ack) + len(self.postpone) + len(self.dead) + len(self.release)
                + len(self.crashed) + len(self.refused) + len(self.ack_held))


class Broker(ABC):
    """A queue server. Instances are not shared across processes: open one after fork."""

    #: Human-readable URL with any password masked (:meth:`parsed_url` parses it).
    safe_url: str = ""
    #: Called now and then, from the calling thread, while a call waits for the broker
    #: to come back (between reconnect attempts): a slot sends its master a heartbeat, so
    #: that waiting for the broker is not taken for hung. Backends whose calls cannot wait
    #: that long (Redis: a few seconds) need not call it.
    on_wait: Callable[[], None] | None = None
    #: True when any process may settle the jobs another one took, with their receipts:
    #: a slot's master gives the jobs of a slot that died back at once (see
    #: :meth:`release`), unstarted ones without charging an attempt (Redis: a lock is a
    #: token in the server). False (RabbitMQ): only the consuming connection can settle
    #: its deliveries, and the server gives them back when it closes.
    settles_for_others: bool = False

    @abstractmethod
    def publish_many(
        self, queue: str, messages: Sequence[tuple[str, bytes]], *, delay_s: float = 0.0
    ) -> list[str]:
        """Store ``(job_id, body)`` messages; none is given out before now + ``delay_s``.
        Returns the ids stored as new jobs, each once, in the order given.

        An id the queue holds already (ready, delayed, locked or dead) is left exactly as
        it is, neither made ready again nor given a new body, so publishing a job again
        (after an error, or ReplicationUnconfirmed) never hands it to a second slot
        (Redis and the embedded broker). RabbitMQ cannot look a message up by id: every
        message is stored and returned as new, and an id published twice is two jobs
        (README, "Backend semantics").

        Returns only once the broker holds every message (Redis: the script ran;
        RabbitMQ: publisher confirms). Raises BrokerUnavailable after retries.
        """

    def publish(self, queue: str, job_id: str, body: bytes, *, delay_s: float = 0.0) -> bool:
        """True when ``job_id`` was stored as a new job (see :meth:`publish_many`)."""
        return bool(self.publish_many(queue, [(job_id, body)], delay_s=delay_s))

    @abstractmethod
    def take(
        self, queue: str, *, max_jobs: int, lock_timeout_s: float, wait_s: float = 0.0
    ) -> list[Delivery]:
        """Up to ``max_jobs`` ready jobs, each locked for ``lock_timeout_s``.

        Taking and locking is one server-side step. Each take counts as an attempt.
        Waits up to ``wait_s`` for the first job when none is ready; returns ``[]``
        when none came.
        """

    @abstractmethod
    def settle(self, queue: str, settlement: Settlement) -> None:
        """Apply a batch's outcomes: ack (delete), postpone (unlock, activate later),
        dead (move to the dead-letter store with the reason, kept as
        ``settlement.retention`` says), release (unlock, ready now, the take's attempt
        not counted), crashed (unlock, ready now, counted, suspect), refused (dead, the
        take not counted)."""

    def settle_and_take(
        self, queue: str, settlement: Settlement, *, max_jobs: int, lock_timeout_s: float,
        wait_s: float = 0.0, read_ahead: bool = False,
    ) -> list[Delivery]:
        """``settle`` then ``take``; backends that can do both in one round trip do.

        ``read_ahead`` (the slot's handler is fast): a backend whose take costs more
        than a round trip may lock the next ``max_jobs`` in advance, so that they are on
        their way while this batch runs (RabbitMQ: prefetch twice the batch). They are
        locked like taken jobs and come back the same way if the slot dies.
        """
        self.settle(queue, settlement)
        return self.take(queue, max_jobs=max_jobs, lock_timeout_s=lock_timeout_s, wait_s=wait_s)

    def leave(self, queue: str) -> None:
        """This process stops taking from ``queue`` for now (a slot switching queues or
        stopping): unstarted read-ahead deliveries are given back without counting an
        attempt. The default does nothing (a backend that reads nothing ahead)."""
        return None

    def release(self, queue: str, deliveries: Sequence[Delivery]) -> None:
        """Give taken but unstarted jobs back: ready at once, attempts unchanged.

        Where :attr:`settles_for_others` is True, another process may do it for the
        process that took them (a master for a slot that died, a rolling reload): each
        delivery needs only its ``id``, ``receipt`` and ``activate_at``, as the taking
        process saw them; a job whose lock expired meanwhile is left as it is."""
        self.settle(queue, Settlement(release=list(deliveries)))

    def ack(self, queue: str, deliveries: Sequence[Delivery]) -> None:
        self.settle(queue, Settlement(ack=list(deliveries)))

    def postpone(self, queue: str, delivery: Delivery, delay_s: float) -> None:
        self.settle(queue, Settlement(postpone=[(delivery, delay_s)]))

    def dead(
        self, queue: str, delivery: Delivery, reason: str, *,
        retention: DeadRetention | None = None,
    ) -> None:
        self.settle(queue, Settlement(dead=[(delivery, reason)], retention=retention))

    @abstractmethod
    def stats(self, queue: str) -> QueueStats:
        """Exact counts for the queue (see the README for RabbitMQ's approximations)."""

    @abstractmethod
    def queues(self) -> list[str]:
        """Names of the queues this broker has seen (published to or taken from)."""

    @abstractmethod
    def dead_jobs(self, queue: str, *, limit: int = 100) -> list[DeadJob]:
        """The dead-letter store, newest first, at most ``limit``."""

    @abstractmethod
    def requeue_dead(self, queue: str, ids: Sequence[str] | None = None) -> int:
        """Move the dead jobs ``ids`` (None: every one) back to ready with attempts
        reset; returns how many (ids that are not dead letters are skipped)."""

    def dead_page(self, queue: str, *, offset: int = 0, limit: int = 50
                  ) -> tuple[int, list[DeadJob]]:
        """The number of dead letters and a page of them: newest first on Redis and the
        embedded broker, oldest first on RabbitMQ (its store is a queue)."""
        raise NotImplementedError(f"{type(self).__name__} cannot page dead letters")

    def delete_dead(self, queue: str, ids: Sequence[str]) -> int:
        """Delete the dead jobs ``ids``; returns how many were dead letters."""
        raise NotImplementedError(f"{type(self).__name__} cannot delete dead letters")

    def job(self, job_id: str, *, queues: Sequence[str] | None = None) -> JobInfo | None:
        """Where job ``job_id`` is: in ``queues`` (None: every queue the broker knows);
        None when it is found nowhere. A state the backend cannot know is ``unknown``
        with a note saying what cannot be known."""
        raise NotImplementedError(f"{type(self).__name__} cannot look jobs up")

    def job_page(self, queue: str, state: str, *, offset: int = 0, limit: int = 50,
                 running: Sequence[JobInfo] = ()) -> JobPage:
        """A page of the queue's jobs in ``state`` (running, delayed, retrying, dead).
        ``running``: what the masters report running (hosts and slots), merged in."""
        raise NotImplementedError(f"{type(self).__name__} cannot list jobs")

    @abstractmethod
    def purge(self, queue: str) -> int:
        """Delete every ready and delayed job of the queue; returns how many.

        Locked and dead jobs are kept (locked ones are being worked on)."""

    # --- periodic jobs (qcluster.periodic; the manager's ticker) ----------------------

    def publish_tick(self, queue: str, job: str, tick_ms: int, job_id: str,
                     body: bytes) -> bool:
        """Enqueue periodic job ``job``'s tick ``tick_ms`` (the job ``job_id``, ``body``,
        ready now) and record ``tick_ms`` as its last enqueued tick, as one step, unless
        the record holds ``tick_ms`` or a later tick. True when this call enqueued it;
        False when the record already held it (another manager, or an earlier call whose
        reply was lost: the tick is enqueued either way).

        Calling it again after any error is safe: whatever happened to the first call (a
        late reply, a reset, a retry, a failover), the tick is enqueued once. Raises
        BrokerError when the broker does not answer (the tick may or may not be
        enqueued: the record, read again, says), ReplicationUnconfirmed when it is
        enqueued and recorded on a master that no replica confirmed in time."""
        raise NotImplementedError(f"{type(self).__name__} cannot run periodic jobs")

    def last_ticks(self) -> dict[str, int]:
        """Each periodic job's recorded last enqueued tick (ms since the epoch)."""
        raise NotImplementedError(f"{type(self).__name__} cannot run periodic jobs")

    def durability(self) -> list[str]:
        """Notes on how safely the server keeps acknowledged jobs, for operators
        (``qcluster stats``, the admin page); empty when there is nothing to say."""
        return []

    # --- operator controls (qcluster.controls; the manager's pause and drain) ---------

    def read_controls(self) -> dict[str, bytes] | None:
        """Every stored control, ``KIND:NAME`` -> its stored value. None: they cannot be
        read just now (RabbitMQ: another process holds them for a moment); the caller
        keeps what it read last. Raises BrokerError when the broker does not answer."""
        raise NotImplementedError(f"{type(self).__name__} cannot store controls")

    def write_control(self, key: str, value: bytes | None) -> None:
        """Store ``value`` under ``key`` (``KIND:NAME``), replacing it; None deletes it.
        Returns once the broker holds the change."""
        raise NotImplementedError(f"{type(self).__name__} cannot store controls")

    # --- capabilities: each has a default for a backend without the feature ---------

    def set_queue_options(self, queue: str, *, queue_type: str | None = None,
                          max_attempts: int = DEFAULT_MAX_ATTEMPTS) -> None:
        """What this process knows of ``queue``'s policy, told before the queue is
        declared: its ``queue_type`` and ``max_attempts`` (RabbitMQ: the queue's type and a
        quorum queue's delivery limit). The default: the backend has no such option."""
        return None

    def delete_queue(self, queue: str) -> None:
        """Remove the queue and everything it holds (tests and tooling; loses jobs)."""
        raise NotImplementedError(f"{type(self).__name__} cannot delete queues")

    def parsed_url(self) -> BrokerUrl | None:
        """:attr:`safe_url` parsed (no passwords in it); None when it names no known
        broker (a stand-in)."""
        try:
            return parse_broker_url(self.safe_url) if self.safe_url else None
        except ConfigError:
            return None

    def kind(self) -> str:
        """What the broker is made of, as health pages name it: ``redis``,
        ``redis-sentinel``, ``redis-cluster``, ``embedded``, ``rabbitmq``; else the
        backend's class name."""
        parsed = self.parsed_url()
        return parsed.kind if parsed is not None else type(self).__name__

    def reader(self) -> Broker:
        """The broker another thread's reads use (the manager's job lookups): this one when
        its client serves every thread (Redis: a pool gives each a connection), else a new
        connection of its own to the same server (RabbitMQ)."""
        return self

    def redis_client(self) -> Any | None:
        """The redis-py client of a Redis backend (a Sentinel master pool or a Cluster
        client: the health page reads the servers behind it); None for other backends."""
        return None

    @abstractmethod
    def ping(self) -> None:
        """Raise BrokerUnavailable if the broker does not answer."""

    @abstractmethod
    def close(self) -> None:
        """Release connections. Unsettled jobs of this process come back later."""

    def __enter__(self) -> Broker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
