"""The producer API: enqueue jobs, read counts, manage dead letters."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qcluster import otel
from qcluster.broker import SHORT_LIVED_GIVE_UP_S, Broker, DeadJob, open_broker
from qcluster.errors import ClientClosed
from qcluster.job import DEFAULT_MAX_MESSAGE_BYTES, check_delay, encode_new_jobs
from qcluster.jobs import JobInfo
from qcluster.names import check_job_id, check_queue_name, closest

if TYPE_CHECKING:
    from qcluster.app import App, QueueSpec

logger = logging.getLogger(__name__)


class Client:
    """A connection to the queue server for producers and tooling.

    ``broker_url`` resolves as: the argument > ``QCLUSTER_BROKER_URL`` >
    ``qcluster.toml`` > the embedded broker under ``state_dir``.

    ``app`` (optional): the application whose queues this producer feeds. With it, a
    job is refused above its queue's ``max_message_bytes``, and enqueueing to a queue it
    does not declare logs a warning, once per queue. Without it, so does a near miss of a
    queue the apps known here declare (those below): a typo, not another app's queue.

    Without it, a queue's policies are those of an app that declares it: one this process
    created (imported), else the settings' ``app`` (``QCLUSTER_APP``, ``qcluster.toml``) if
    it imports. A queue is declared as those policies say (on RabbitMQ its type is fixed by
    whoever declares it first); a queue no app known here declares is declared as the
    broker URL says (``?queue_type=``, else classic) and its messages are limited to
    ``max_message_bytes`` (1 MiB by default). docs/operations.md, "Quorum queues".

    ``give_up_s``: a call that cannot reach the broker (refused, dropped) raises
    BrokerUnavailable after retrying this long, 2 s by default (one connect or reply
    timeout more, 5 s, for a broker that does not answer at all); a producer that would
    rather wait through a broker's restart gives more. None: as slots do (5 retries with
    backoff, then BrokerUnavailable). docs/operations.md, "When the broker does not
    answer".

    One Client may be shared by threads and by the processes forked after it was made:
    a RabbitMQ connection serves one thread of one process, so each other thread or
    process gets a connection of its own at its first call (Redis: one pool serves all).
    Once closed (``close()``, the end of its ``with`` block) it refuses every call
    (:class:`~qcluster.errors.ClientClosed`).
    """

    def __init__(
        self,
        broker_url: str | None = None,
        *,
        state_dir: str | Path | None = None,
        max_message_bytes: int | None = None,
        app: App | None = None,
        give_up_s: float | None = SHORT_LIVED_GIVE_UP_S,
    ) -> None:
        from qcluster.config import load_settings

        settings = load_settings(None, broker_url=broker_url, state_dir=state_dir)
        self._brokers = _PerThread(open_broker(settings.broker_url,
                                               state_dir=settings.state_dir,
                                               give_up_s=give_up_s))
        self.max_message_bytes = max_message_bytes
        self.app = app
        self._settings_app = settings.app
        """The settings' app (imported only when no app of this process declares a queue)."""
        self._specs: dict[str, QueueSpec | None] = {}
        """Each queue's declaration as found (None: no app known here declares it)."""
        if app is not None:
            for spec in app.queues.values():
                self._declare_as_policy_says(spec)

    @property
    def broker(self) -> Broker:
        """The broker this thread's calls use."""
        return self._brokers.here()

    def _declare_as_policy_says(self, spec: QueueSpec) -> None:
        """On RabbitMQ a queue's type is fixed by whoever declares it first, which may be
        this producer: it declares the queue as its policy says (``queue_type``, a quorum
        queue's delivery limit from ``max_attempts``), from whichever thread enqueues
        first. Other brokers have no such option."""
        self._specs[spec.name] = spec
        self._brokers.tell(lambda broker: broker.set_queue_options(
            spec.name, queue_type=spec.policy.queue_type,
            max_attempts=spec.policy.max_attempts))

    def _spec(self, queue: str) -> QueueSpec | None:
        """The declaration of ``queue`` this producer follows, found once per queue: the
        ``app`` given, else an app of this process, else the settings' app."""
        if queue in self._specs:
            return self._specs[queue]
        from qcluster.app import LIVE_APPS

        apps = [self.app] if self.app is not None else list(LIVE_APPS)
        spec = next((app.queues[queue] for app in apps if queue in app.queues), None)
        if spec is None and self.app is None and self._settings_app:
            settings_app = _settings_app(self._settings_app)
            if settings_app is not None:
                apps.append(settings_app)
                spec = settings_app.queues.get(queue)
        if spec is None:
            self._specs[queue] = None
            if warning := _undeclared(queue, apps, feeds_only=self.app is not None):
                logger.warning("%s", warning)  # a typo'd name would wait forever, unseen
        else:
            self._declare_as_policy_says(spec)
        return spec

    def enqueue(
        self, queue: str, payload: Any, *, delay: float = 0.0, headers: dict[str, str] | None = None
    ) -> str:
        """Store one job; returns its id once the broker has it."""
        return self.enqueue_many(queue, [payload], delay=delay, headers=headers)[0]

    def enqueue_many(
        self,
        queue: str,
        payloads: Iterable[Any],
        *,
        delay: float = 0.0,
        headers: dict[str, str] | None = None,
    ) -> list[str]:
        """Store many jobs in as few round trips as the backend allows; returns their ids.

        Raises InvalidQueueName or InvalidDelay (both ValueErrors) for a bad queue name
        or a delay that is not finite, negative or over a year (MAX_DELAY_S), and
        EnvelopeError for a payload that is not JSON or too big; nothing is stored then.
        """
        check_queue_name(queue)
        delay = check_delay(delay)
        self._spec(queue)
        if otel.ENABLED and otel.active():  # traced: the trace context goes with the jobs
            with otel.enqueue_span(queue, headers) as traced:
                return self._publish(queue, payloads, delay, traced)
        return self._publish(queue, payloads, delay, headers)

    def _publish(self, queue: str, payloads: Iterable[Any], delay: float,
                 headers: dict[str, str] | None) -> list[str]:
        messages = encode_new_jobs(queue, payloads, enqueued_at=time.time(),
                                   random_bytes=os.urandom, headers=headers,
                                   max_bytes=self._max_bytes(queue))
        if messages:
            self.broker.publish_many(queue, messages, delay_s=delay)
        return [job_id for job_id, _ in messages]

    def declares(self, queue: str) -> bool | None:
        """Whether the client's app declares ``queue`` (None: no app, unknown)."""
        return None if self.app is None else queue in self.app.queues

    def _max_bytes(self, queue: str) -> int:
        if self.max_message_bytes is not None:
            return self.max_message_bytes
        spec = self._spec(queue)
        return DEFAULT_MAX_MESSAGE_BYTES if spec is None else spec.policy.max_message_bytes

    def stats(self, queue: str) -> dict[str, int]:
        """``{"ready", "locked", "delayed", "dead"}`` counts for the queue."""
        return self.broker.stats(queue).model_dump()

    def dead_jobs(self, queue: str, limit: int = 100) -> list[DeadJob]:
        return self.broker.dead_jobs(queue, limit=limit)

    def requeue_dead(self, queue: str) -> int:
        return self.broker.requeue_dead(queue)

    def job(self, job_id: str, *, queue: str | None = None) -> JobInfo:
        """Where job ``job_id`` is and since when (state ``unknown`` when no queue
        holds it, nor a record of it: finished jobs are remembered for their queue's
        ``keep_finished_s``). ``queue``: look in that queue only."""
        found = self.broker.job(check_job_id(job_id),
                                queues=None if queue is None else [queue])
        if found is None:
            return JobInfo(id=job_id, queue=queue, state="unknown",
                           note="no queue holds it (finished jobs are remembered for their "
                                "queue's keep_finished_s only)")
        return found

    def purge(self, queue: str) -> int:
        return self.broker.purge(queue)

    def queues(self) -> list[str]:
        return self.broker.queues()

    def close(self) -> None:
        self._brokers.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _PerThread:
    """A broker per thread and process, for a backend whose connection serves one thread
    (RabbitMQ; :meth:`Broker.reader`); the one given for a backend that serves them all."""

    def __init__(self, first: Broker) -> None:
        self._first = first
        self._owner = (os.getpid(), threading.get_ident())
        self._others: dict[tuple[int, int], Broker] = {}
        self._told: list[Callable[[Broker], None]] = []
        """What every broker is told (the queues' options), replayed to each new one."""
        self._lock, self._lock_pid = threading.Lock(), os.getpid()
        self._shared: bool | None = None
        """Whether ``first`` serves every thread (None: not asked yet)."""
        self._closed = False

    def here(self) -> Broker:
        """This thread's broker, opened at its first call."""
        if self._closed:  # a call would open connections that nobody closes
            raise ClientClosed("this Client is closed (close() or the end of its with "
                               "block): make a new one")
        key = (os.getpid(), threading.get_ident())
        if key == self._owner or self._shared:
            return self._first
        broker = self._others.get(key)
        return broker if broker is not None else self._open(key)

    def _locked(self) -> threading.Lock:
        """The lock, new in a forked process (another thread may have held it at the
        fork, and nobody would release it there)."""
        if self._lock_pid != os.getpid():
            self._lock, self._lock_pid = threading.Lock(), os.getpid()
        return self._lock

    def _open(self, key: tuple[int, int]) -> Broker:
        with self._locked():
            broker = self._first.reader()
            self._shared = broker is self._first
            if self._shared:
                return broker
            self._close_finished_threads(key[0])
            for tell in self._told:
                tell(broker)
            self._others[key] = broker
            return broker

    def _close_finished_threads(self, pid: int) -> None:
        """Close the brokers of threads that ended (a pool replaces its threads), and
        forget those of other processes (their connections belong to them)."""
        alive = {thread.ident for thread in threading.enumerate()}
        for key in list(self._others):
            if key[0] != pid:
                del self._others[key]
            elif key[1] not in alive:
                self._others.pop(key).close()

    def tell(self, what: Callable[[Broker], None]) -> None:
        """Tell every broker, and each one opened later, ``what``."""
        with self._locked():
            self._told.append(what)
            for broker in (self._first, *self._others.values()):
                what(broker)

    def close(self) -> None:
        """Close this process's brokers (a forked process leaves its parent's open)."""
        if self._closed:
            return
        self._closed = True
        with self._locked():
            mine = os.getpid()
            for (pid, _), broker in self._others.items():
                if pid == mine:
                    broker.close()
            self._others.clear()
        if self._owner[0] == os.getpid():
            self._first.close()


#: Queue names a warning lists at most.
NAMES_SHOWN = 10


def _undeclared(queue: str, apps: list[App], *, feeds_only: bool) -> str:
    """What to say of ``queue``, which none of ``apps`` declares ('' : nothing). A producer
    given its ``app`` feeds that app only: any other name is said. Otherwise the apps this
    process knows may be some of the cluster's: only a near miss of their queues (a typo)
    is said, another app's queue is not."""
    known = sorted({name for app in apps for name in app.queues})
    close = closest(queue, known, cutoff=0.7)
    if not apps or not (feeds_only or close):
        return ""
    more = f" and {len(known) - NAMES_SHOWN} more" if len(known) > NAMES_SHOWN else ""
    hint = (f"did you mean {close}?" if close
            else f"known: {', '.join(known[:NAMES_SHOWN]) or 'none'}{more}")
    names = " or ".join(sorted({repr(app.name) for app in apps}))
    return (f"enqueue to {queue!r}: no queue of app {names} has that name, so no slot will "
            f"run these jobs ({hint})")


def _settings_app(target: str) -> App | None:
    """The settings' app; None when it cannot be imported here (a producer often runs
    without the workers' code: logged once)."""
    from qcluster.app import load_app
    from qcluster.errors import AppImportError

    try:
        return load_app(target)
    except Exception as exc:  # the workers' code, broken or not importable here
        if target not in _unimportable:
            _unimportable.add(target)
            # Not importable here is common (a producer without the workers' code); one
            # that raises while importing (a setting only the workers have, a bad
            # declaration) is said louder, but it must not fail the producer's enqueue.
            level = logging.INFO if isinstance(exc, AppImportError) else logging.WARNING
            logger.log(level, "queues are declared as the broker URL says, not as app %s "
                       "says: %s: %s", target, type(exc).__name__, " ".join(str(exc).split()))
        return None


_unimportable: set[str] = set()
