"""The slot loop (shared/DESIGN.md section 3).

take a batch -> tell the master "batch started, deadline T" -> run the handler ->
settle the outcomes in one round trip -> counters -> now and then check our own
Private_Dirty -> obey master commands. Runs forked by the master (with a channel)
or in the foreground (``qcluster slot``).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import random
import signal
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from qcluster import exitcodes, metrics, otel
from qcluster.app import App, QueueSpec
from qcluster.broker import Broker, Settlement, open_broker
from qcluster.channel import Channel
from qcluster.errors import BrokerError, EnvelopeError
from qcluster.failures import JobError
from qcluster.hooks import Failure
from qcluster.job import JSON_CONTENT_TYPE, Delivery, Job, decode_envelope
from qcluster.messages import (
    BatchCounters,
    BatchDone,
    BatchStarted,
    GaveBack,
    GiveBack,
    Heartbeat,
    MasterToSlot,
    Progress,
    Recycling,
    SlotHello,
    SlotRefused,
    StopSlot,
    SwitchQueue,
)
from qcluster.slot import identity
from qcluster.slot.aio import run_async_batch
from qcluster.slot.failure_report import FailureReporter
from qcluster.slot.settle import dead_retention, give_back_settlement, settle_batch, taken_out

logger = logging.getLogger(__name__)

#: How long an idle take blocks; bounds how fast SIGTERM and commands are noticed.
IDLE_WAIT_S = 0.5
#: Seconds between heartbeats when nothing else was sent.
HEARTBEAT_INTERVAL_S = 1.0
#: Seconds between reads of our own /proc/self/smaps_rollup (about 50 us each).
MEMORY_CHECK_INTERVAL_S = 1.0
#: Small batches of fast handlers: jobs fetched per take (run batch_size at a time).
PREFETCH_JOBS = 32
#: A batch faster than this allows prefetching the next ones.
PREFETCH_FAST_BATCH_S = 0.005
#: Stop running prefetched batches after this long; the rest goes back to the queue.
PREFETCH_MAX_S = 0.5
#: Seconds a slot counts in memory before writing its metrics (see _SlotMetrics).
METRICS_WRITE_INTERVAL_S = 0.25
#: Pause after a broker error before trying again (the client retries inside too).
BROKER_ERROR_PAUSE_S = 1.0
_RUNNING = bytes([Progress.RUNNING]) * 4096
_DONE = bytes([Progress.DONE]) * 4096


class SlotRunner:
    """One slot's loop. Construct after fork; :meth:`run` returns the exit code."""

    def __init__(
        self,
        app: App,
        queue: str,
        broker: Broker,
        *,
        channel: Channel[MasterToSlot] | None = None,
        slot_no: int | None = None,
        burst: bool = False,
    ) -> None:
        self.app = app
        self.spec: QueueSpec = app.spec(queue)
        self._retention = dead_retention(self.spec.policy)
        """Passed with every settlement: the broker applies it to the queue's dead letters."""
        self.broker = broker
        self.channel = channel
        # While a broker call waits for the broker to come back (RabbitMQ reconnects through
        # a dead link for up to a minute), the master still hears from this slot.
        broker.on_wait = self._waiting_for_broker
        self.slot_label = str(slot_no if slot_no is not None else os.getpid())
        self.burst = burst
        self.should_stop = False
        self.rand = random.Random()
        self.metrics = _SlotMetrics(self.slot_label) if metrics.multiprocess_enabled() else None
        self.failures = FailureReporter(
            self.slot_label, identity.host, app.failure_hooks,
            count=self.metrics.count_failures if self.metrics else None)
        self._failed: list[Failure] = []
        """Failures of the batch that just ran, reported once it is done (a successful
        batch never fills it)."""
        self._last_sent = 0.0
        self._fast_batches = False
        self._one_at_a_time = False
        """The last take held suspect jobs: take one job at a time until a take has none
        (each suspect runs alone without re-reading its batch-mates every time)."""
        self._pending = Settlement()
        """Outcomes of the last batch, settled with the next take (see step)."""
        self._progress = getattr(channel, "progress", None)
        """Shared with the master: how far this slot got through its take (None: not
        followed, e.g. no master or a broker whose locks only this process can settle)."""
        if not broker.settles_for_others:
            self._progress = None
        self._take_seq = 0
        """The take followed in TakeProgress (0: none)."""
        self._take_count = 0
        self._per_job = _runs_each_job(self.spec)
        self._tell_broker_policy()
        self._next_memory_check = time.monotonic() + MEMORY_CHECK_INTERVAL_S

    # --- lifecycle -----------------------------------------------------------

    def handle_stop_signal(self, signum: int, frame: FrameType | None) -> None:
        """SIGTERM/SIGINT: finish and settle the current batch, then exit. Flag only."""
        self.should_stop = True

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.handle_stop_signal)
        signal.signal(signal.SIGINT, self.handle_stop_signal)
        self._send(SlotHello(slot_no=int(self.slot_label), pid=os.getpid(), queue=self.queue))
        identity.set_title("slot", self.queue)
        try:
            return self._loop()
        finally:
            self.failures.flush()
            self._flush()
            self._leave(self.queue)
            if self.metrics:
                self.metrics.write()
            self.broker.close()

    @property
    def queue(self) -> str:
        return self.spec.name

    def _loop(self) -> int:
        while True:
            self._obey_master()
            if self.should_stop:
                return exitcodes.OK
            try:
                worked = self.step(defer_settle=True)
            except BrokerError as exc:
                if refused_for_good(exc):
                    return self._refused(exc)
                logger.warning("slot %s: broker error on %s: %s", self.slot_label, self.queue, exc)
                self._heartbeat(idle=True)  # waiting for the broker is not hung
                time.sleep(BROKER_ERROR_PAUSE_S)
                continue
            except Exception:  # a slot must never die of one bad job or reply
                logger.exception("slot %s: unexpected error on %s", self.slot_label, self.queue)
                self._heartbeat(idle=True)
                time.sleep(BROKER_ERROR_PAUSE_S)
                continue
            if not worked and self.burst:
                return exitcodes.OK
            if self._over_memory_limit():
                return exitcodes.RECYCLE

    def _refused(self, exc: BrokerError) -> int:
        """The broker refused the queue for good: say why once, tell the master, stop."""
        reason = " ".join(str(exc).split())[:1000]
        logger.error("slot %s: cannot serve %s: %s. No retry can fix this: the slot stops "
                     "(exit %d)", self.slot_label, self.queue, reason, exitcodes.BROKER_REFUSED)
        self._send(SlotRefused(reason=reason))
        return exitcodes.BROKER_REFUSED

    def step(self, *, defer_settle: bool = False) -> bool:
        """Take and process one batch (or a few small ones); False when nothing was ready.

        With small batches and fast handlers one take fetches several batches (up to
        PREFETCH_JOBS jobs) and runs them batch_size at a time, and all outcomes are
        settled in one round trip: the broker is paid per take, not per job.
        ``defer_settle`` (the slot loop): the outcomes are settled together with the
        next take, in the same round trip where the backend can (Redis).
        """
        policy = self.spec.policy
        pending, self._pending = self._pending, Settlement()
        try:
            deliveries = self.broker.settle_and_take(
                self.queue, pending, max_jobs=self._take_size(),
                lock_timeout_s=policy.lock_timeout, wait_s=0.0 if self.burst else IDLE_WAIT_S,
                read_ahead=self._fast_batches,
            )
        except BrokerError:
            self._pending = pending  # settling again is harmless: try with the next take
            raise
        except Exception:
            self._salvage(pending)
            raise
        if not deliveries:
            if self._progress is not None:
                self._progress.clear()  # the last take is settled: nothing held
            if self.metrics:
                self.metrics.write()
            self._heartbeat(idle=True)
            return False
        self._one_at_a_time = any(delivery.suspect for delivery in deliveries)
        if self._one_at_a_time:
            deliveries = self._one_suspect(deliveries)
        if self._progress is not None:
            self._follow(deliveries)
        taken = time.monotonic()
        settlement = Settlement(retention=self._retention)
        size = policy.batch_size
        for start in range(0, len(deliveries), size):
            if start and not self._may_run_more(taken):
                # Hand the rest back unstarted (no attempt counted) rather than run it
                # near its lock expiry or after SIGTERM.
                settlement.release.extend(deliveries[start:])
                break
            chunk = deliveries[start : start + size]
            self._send(BatchStarted(
                queue=self.queue, size=len(chunk),
                deadline_mono=time.monotonic() + policy.batch_timeout,
            ))
            part, counters = self._run_batch(chunk, start if self._take_seq else -1)
            settlement.ack += part.ack
            settlement.postpone += part.postpone
            settlement.dead += part.dead
            settlement.refused += part.refused
            if part.errors:
                settlement.errors.update(part.errors)
            self._send(BatchDone(queue=self.queue, counters=counters))
        if self._failed:
            self._settle_then_report(settlement, taken, defer_settle=defer_settle)
        elif defer_settle:
            self._pending = settlement
        else:
            self.broker.settle(self.queue, settlement)
        return True

    def _settle_then_report(self, settlement: Settlement, taken: float, *,
                            defer_settle: bool) -> None:
        """A take where a handler raised: settle it at once (one more round trip, paid
        by failed takes only), then log and call the hooks. Settled first, the jobs'
        outcome never waits for a hook, and a slot killed while a hook runs holds
        nothing its master would have to give back."""
        try:
            self.broker.settle(self.queue, settlement)
            if self._progress is not None:
                self._progress.clear()  # settled: nothing held
        except BrokerError as exc:
            if not defer_settle:
                raise
            self._pending = settlement  # settling again is harmless: with the next take
            logger.warning("slot %s: could not settle on %s: %s", self.slot_label,
                           self.queue, exc)
        except Exception:
            self._salvage(settlement)
            raise
        finally:
            self._report_failures(taken)

    def _tell_broker_policy(self) -> None:
        """What the broker must know of the queue's policy before declaring it (RabbitMQ:
        ``queue_type``, and ``max_attempts`` for a quorum queue's delivery limit)."""
        set_options = getattr(self.broker, "set_queue_options", None)
        if set_options is not None:
            policy = self.spec.policy
            set_options(self.queue, queue_type=policy.queue_type,
                        max_attempts=policy.max_attempts)

    def _follow(self, deliveries: list[Delivery]) -> None:
        """Start following a new take in the shared TakeProgress (its master reads it if
        this slot dies). Not followed when it holds something a master could not settle
        (a malformed delivery) or does not fit."""
        assert self._progress is not None
        self._take_seq = 0
        receipt = deliveries[0].receipt
        if (isinstance(receipt, int) and not isinstance(receipt, bool)
                and not any(d.malformed for d in deliveries)
                and self._progress.begin(self._take_count + 1, self.queue, receipt, deliveries)):
            self._take_count += 1
            self._take_seq = self._take_count
        else:
            self._progress.clear()

    def _one_suspect(self, deliveries: list[Delivery]) -> list[Delivery]:
        """Of a take holding suspect jobs (their last take ended by lock expiry: a slot
        died or hung, maybe of one of them), keep one suspect and give the rest back at
        once, unstarted. A poison job then only ever dies alone: its batch-mates are
        not charged an attempt for its crashes."""
        first = next(delivery for delivery in deliveries if delivery.suspect)
        others = [delivery for delivery in deliveries if delivery is not first]
        if others:
            self.broker.release(self.queue, others)
        return [first]

    def _salvage(self, pending: Settlement) -> None:
        """Settling failed for a reason other than the broker: settle at least the acks
        (and releases), so finished jobs do not run again; the rest returns at lock expiry."""
        try:
            self.broker.settle(self.queue, Settlement(ack=pending.ack, release=pending.release))
        except Exception as exc:  # the jobs come back when their locks expire
            logger.warning("slot %s: could not settle on %s: %s", self.slot_label, self.queue, exc)

    def _leave(self, queue: str) -> None:
        try:
            self.broker.leave(queue)
        except BrokerError as exc:  # unstarted jobs come back when their locks expire
            logger.warning("slot %s: could not leave %s: %s", self.slot_label, queue, exc)

    def _flush(self) -> None:
        """Settle outcomes still waiting for the next take (stopping, switching queue)."""
        if not len(self._pending):
            return
        pending, self._pending = self._pending, Settlement()
        try:
            self.broker.settle(self.queue, pending)
        except BrokerError as exc:  # the jobs come back when their locks expire
            logger.warning("slot %s: could not settle on %s: %s", self.slot_label, self.queue, exc)

    def _take_size(self) -> int:
        size = self.spec.policy.batch_size
        if self._one_at_a_time:
            return 1
        if size >= PREFETCH_JOBS or not self._fast_batches:
            return size
        return size * (PREFETCH_JOBS // size)

    def _may_run_more(self, taken: float) -> bool:
        """Another prefetched batch may start: its whole batch_timeout fits in the lock."""
        policy = self.spec.policy
        elapsed = time.monotonic() - taken
        return (
            not self.should_stop
            and elapsed < PREFETCH_MAX_S
            and elapsed + policy.batch_timeout + policy.kill_margin <= policy.lock_timeout
        )

    # --- one batch -----------------------------------------------------------

    def _run_batch(
        self, deliveries: Sequence[Delivery], first: int = -1,
    ) -> tuple[Settlement, BatchCounters]:
        """Decode, run and settle one batch; ``first``: the index of its first delivery
        in the take followed in TakeProgress (-1: not followed)."""
        jobs, rejected, malformed = self._decode(deliveries)
        if first >= 0 and jobs:
            jobs = self._mark_running(jobs, deliveries, first)
        if not jobs:
            busy_s = 0.0
        elif otel.ENABLED and otel.active():  # traced: a span per batch and per job
            busy_s = otel.run_traced(self.queue, jobs, lambda: self._run_handler(jobs))
        else:
            busy_s = self._run_handler(jobs)
        # Prefetch only for handlers that finish fast: slow jobs are better spread
        # over every slot of the queue than queued behind each other in one.
        self._fast_batches = busy_s < PREFETCH_FAST_BATCH_S
        settlement, counters = settle_batch(
            jobs, self.spec.policy, rand=self.rand.random, rejected=rejected,
            malformed=malformed, busy_s=busy_s,
        )
        if malformed < len(rejected):  # taken too often: that take was no attempt
            refused = {id(d) for d, why in rejected if why.startswith(TAKEN)}
            settlement.refused = [item for item in settlement.dead if id(item[0]) in refused]
            settlement.dead = [item for item in settlement.dead if id(item[0]) not in refused]
        if counters.done != len(jobs):  # some job did not simply succeed: any exception?
            self._failed += self.failures.collect(self.queue, jobs, settlement,
                                                  self.spec.policy, time.time())
        if first >= 0 and jobs:
            self._mark_outcomes(jobs, deliveries, first, len(settlement.ack))
        if self.metrics:
            self.metrics.observe(self.queue, jobs, counters)
        return settlement, counters

    def _decode(
        self, deliveries: Sequence[Delivery]
    ) -> tuple[list[Job], list[tuple[Delivery, str]], int]:
        policy = self.spec.policy
        jobs: list[Job] = []
        rejected: list[tuple[Delivery, str]] = []
        malformed = 0
        for delivery in deliveries:
            try:
                if delivery.content_type != JSON_CONTENT_TYPE or delivery.malformed:
                    raise EnvelopeError(
                        delivery.malformed or f"refused content type {delivery.content_type!r}")
                envelope = decode_envelope(delivery.body, max_bytes=policy.max_message_bytes)
                job = Job.from_delivery(delivery, envelope)
            except EnvelopeError as exc:
                rejected.append((delivery, str(exc)))
                malformed += 1
                continue
            except Exception as exc:  # never die of input: whatever it is, it is malformed
                rejected.append((delivery, f"malformed: {type(exc).__name__}: {exc}"[:1000]))
                malformed += 1
                continue
            if delivery.attempts > policy.max_attempts:
                # Taken more often than allowed without ever being settled: its slots
                # died or hung on it. Running it again would likely kill this one too.
                rejected.append((delivery, taken_out(delivery.attempts, policy)))
                continue
            jobs.append(job)
        return jobs, rejected, malformed

    def _mark_running(
        self, jobs: list[Job], deliveries: Sequence[Delivery], first: int
    ) -> list[Job]:
        """Before the handler: a batch handler gets every job at once (all RUNNING); a
        per-job one (``app.job_queue``) marks each job as it reaches it."""
        assert self._progress is not None
        states, size = self._progress.states, len(deliveries)
        if size == 1:  # the common small batch: one store
            states[first] = Progress.RUNNING
        elif self._per_job and len(jobs) == size:  # job n is delivery first + n
            return _MarksEachJob(jobs, states, first)
        else:
            states[first : first + size] = _RUNNING[:size]
        return jobs

    def _mark_outcomes(
        self, jobs: list[Job], deliveries: Sequence[Delivery], first: int, acked: int
    ) -> None:
        """After the handler: DONE for the acked jobs (all of them, the common case: one
        slice), RAN or FAILED for the others; jobs refused before the handler stay
        UNSTARTED (given back, they are refused again)."""
        assert self._progress is not None
        states = self._progress.states
        if acked == len(deliveries):
            if acked == 1:
                states[first] = Progress.DONE
            else:
                states[first : first + acked] = _DONE[:acked]
            return
        where = {id(delivery): first + n for n, delivery in enumerate(deliveries)}
        for job in jobs:
            states[where[id(job.delivery)]] = _state_of(job)

    def _give_back(self, command: GiveBack) -> None:
        """Settle what a slot of our master held when it died (the master has no broker
        connection). A failure leaves them to their lock expiry, as before."""
        try:
            policy = self.app.spec(command.queue).policy
            now = time.time()
            settlement = give_back_settlement(command.jobs, command.receipt, policy,
                                              rand=self.rand.random, now=now)
            died = [delivery for delivery in settlement.crashed]
            died += [delivery for delivery, why in settlement.dead if why.startswith(DIED)]
            for delivery in died:  # what is known of them: their slot died running them
                settlement.errors[delivery.id] = JobError.bounded(
                    type="SlotDied", message=DIED, traceback="", host=identity.host,
                    slot="", attempt=delivery.attempts, at=now)
            self.broker.settle(command.queue, settlement)
        except Exception as exc:  # never die of it: the locks expire
            logger.warning("slot %s: could not give back a dead slot's %d jobs of %s: %s",
                           self.slot_label, len(command.jobs), command.queue, exc)
            return
        finally:
            self._send(GaveBack(ref=command.ref))
        logger.info("slot %s: gave back a dead slot's jobs of %s: %d unstarted, %d "
                    "crashed, %d dead, %d acked, %d retried", self.slot_label, command.queue,
                    len(settlement.release), len(settlement.crashed), len(settlement.dead),
                    len(settlement.ack_held), len(settlement.postpone))

    def _report_failures(self, taken: float) -> None:
        """Log, count and hand to the hooks what failed in the take that just ran; the
        hooks get at most what is left of the take's lock (less the kill margin), and
        the master hears from the slot while it waits for them (it judges a slot
        outside a batch by its heartbeat)."""
        failed, self._failed = self._failed, []
        policy = self.spec.policy
        budget = policy.lock_timeout - policy.kill_margin - (time.monotonic() - taken)
        self.failures.report(failed, budget, alive=self._heartbeat_busy)

    def _heartbeat_busy(self) -> None:
        self._heartbeat(idle=False)

    def _run_handler(self, jobs: list[Job]) -> float:
        started = time.perf_counter()
        try:
            result = self.spec.handler(jobs)
            if result is not None:
                if self.spec.is_async:  # the coroutine: run on the slot's loop (slot/aio.py)
                    result = run_async_batch(self.spec, jobs, result)
                if result is not None:
                    _refuse_result(result)
        except Exception as exc:  # the handler's failure is the jobs' outcome (logged after)
            for job in jobs:
                if job.outcome is None:
                    job.mark_error(exc)
        return time.perf_counter() - started

    # --- master channel ------------------------------------------------------

    def _send(self, message: Any) -> None:
        if self.channel is not None:
            self.channel.send(message)
            self._last_sent = time.monotonic()

    def _waiting_for_broker(self) -> None:
        self._heartbeat(idle=True)

    def _heartbeat(self, *, idle: bool) -> None:
        if self.channel is not None and time.monotonic() - self._last_sent >= HEARTBEAT_INTERVAL_S:
            self._send(Heartbeat(queue=self.queue, idle=idle))

    def _obey_master(self) -> None:
        if self.channel is None:
            return
        for command in self.channel.receive():
            if isinstance(command, StopSlot):
                self.should_stop = True
            elif isinstance(command, GiveBack):
                self._give_back(command)
            elif isinstance(command, SwitchQueue) and command.queue != self.queue:
                self._flush()  # outcomes belong to the old queue
                self._leave(self.queue)  # and its read-ahead jobs go back, unstarted
                self.spec = self.app.spec(command.queue)
                self._per_job = _runs_each_job(self.spec)
                self._tell_broker_policy()
                self._retention = dead_retention(self.spec.policy)
                identity.set_title("slot", self.queue)
                logger.info("slot %s: switched to %s", self.slot_label, command.queue)
        if self.channel.closed:
            self.should_stop = True  # the master is gone: never run unsupervised

    # --- memory --------------------------------------------------------------

    def _over_memory_limit(self) -> bool:
        now = time.monotonic()
        if now < self._next_memory_check:
            return False
        # Jitter so that slots forked together do not all recycle in the same second.
        self._next_memory_check = now + MEMORY_CHECK_INTERVAL_S * (0.5 + self.rand.random())
        self.failures.tick(now)  # (here: once a second or so, off the per-batch path)
        from qcluster.procfs import read_memory

        sample = read_memory("self")
        if sample is None:
            return False
        limit = int(self.spec.policy.private_dirty_limit_mb * 1024 * 1024)
        if self.metrics:
            self.metrics.private_dirty(self.queue, sample.private_dirty_bytes)
        if sample.private_dirty_bytes <= limit:
            return False
        logger.info(
            "slot %s: Private_Dirty %d MiB over the %d MiB limit of %s: recycling",
            self.slot_label, sample.private_dirty_bytes >> 20, limit >> 20, self.queue,
        )
        self._send(Recycling(private_dirty_bytes=sample.private_dirty_bytes, limit_bytes=limit))
        return True


TAKEN = "taken"
"""How the reason of a job refused for too many takes starts (see _decode)."""
DIED = "its slot died while running it"


#: Errors of the broker's client that no retry can fix: RabbitMQ's ACCESS_REFUSED (403)
#: and NOT_ALLOWED (530), PRECONDITION_FAILED (406) to an exchange or queue method (a
#: declaration or binding; not an ack, which may fail after a reconnect); Redis's NOPERM.
_REFUSALS = frozenset({"AccessRefused", "NotAllowed", "NoPermissionError"})
_AMQP_TOPOLOGY_CLASSES = (40, 50)  # exchange.*, queue.*


def refused_for_good(exc: BrokerError) -> bool:
    """A broker error that no retry can fix: the queue exists with another type
    (QueueTypeMismatch), or the broker refused a declaration or a permission."""
    if any(kind.__name__ == "QueueTypeMismatch" for kind in type(exc).__mro__):
        return True
    cause = exc.__cause__
    if cause is None:
        return False
    names = {kind.__name__ for kind in type(cause).__mro__}
    if names & _REFUSALS:
        return True
    method = getattr(cause, "method_sig", None) or (0, 0)
    return "PreconditionFailed" in names and method[0] in _AMQP_TOPOLOGY_CLASSES


def _runs_each_job(spec: QueueSpec) -> bool:
    """A sync per-job handler (``app.job_queue``): it runs the batch's jobs one by one
    with ``for job in jobs``, so the slot can mark each as it starts. Not an async one:
    its workers share one iterator and run several jobs at once, so taking the next job
    says nothing about the last one (the whole batch counts as running)."""
    return spec.per_job and not spec.is_async


def _state_of(job: Job) -> int:
    if job.outcome in (None, "done"):
        return Progress.DONE
    return Progress.FAILED if job.outcome == "fail" else Progress.RAN


class _MarksEachJob(list[Job]):
    """A batch for a per-job handler: iterating it marks each job RUNNING as the handler
    reaches it, and the one before DONE/RAN/FAILED by its outcome (a store in shared
    memory per job, no syscall). Only ``for`` is followed: a job reached another way
    stays UNSTARTED until the batch ends (given back uncharged if the slot dies)."""

    def __init__(self, jobs: list[Job], states: memoryview, first: int) -> None:
        super().__init__(jobs)
        self._states, self._first = states, first
        """Job n's state is states[first + n]."""

    def __iter__(self) -> Iterator[Job]:
        states, first = self._states, self._first
        running, done = Progress.RUNNING, Progress.DONE
        index = first
        for job in list.__iter__(self):
            states[index] = running
            yield job
            # The handler came back for the next one (inline: this runs once per job).
            outcome = job.outcome
            states[index] = done if outcome is None or outcome == "done" else _state_of(job)
            index += 1


def _refuse_result(result: object) -> None:
    """A batch handler returns None. Anything else means the work did not happen here:
    a coroutine (``async def``) or generator was created and never run. Close it (no
    "never awaited" warning) and fail the batch instead of acking jobs that never ran."""
    if inspect.iscoroutine(result) or inspect.isgenerator(result):
        with contextlib.suppress(Exception):
            result.close()
    raise TypeError(
        f"the handler returned {type(result).__name__}, not None: a handler must do its "
        "work before returning (async def and generator handlers are not supported)"
    )


_OUTCOMES = ("done", "retried", "failed", "malformed")


class _QueueFigures:
    """One queue's figures since the last write, and the Prometheus children they go to
    (label lookups cost more than the increments, so the children are looked up once)."""

    def __init__(self, defs: Any, queue: str, slot_label: str) -> None:
        self.done = 0
        self.outcomes = dict.fromkeys(_OUTCOMES, 0)
        self.outcome_children = {o: defs.jobs.labels(queue, o) for o in _OUTCOMES}
        self.duration = metrics.HistogramTally(metrics.DURATION_BUCKETS)
        self.size = metrics.HistogramTally(metrics.BATCH_SIZE_BUCKETS)
        self.wait = metrics.HistogramTally(metrics.DURATION_BUCKETS, floor=0.0)
        self.duration_child = defs.batch_duration.labels(queue)
        self.size_child = defs.batch_size.labels(queue)
        self.wait_child = defs.job_wait.labels(queue)
        self.dirty_child = defs.slot_private_dirty.labels(queue, slot_label)

    def add(self, jobs: Sequence[Job], counters: BatchCounters) -> None:
        # Every line here runs once per batch: a no-op slot runs 1,000 batches a second.
        self.done += counters.done
        if counters.retried or counters.failed or counters.malformed:
            outcomes = self.outcomes
            outcomes["retried"] += counters.retried
            outcomes["failed"] += counters.failed
            outcomes["malformed"] += counters.malformed
        self.duration.add(counters.busy_s)
        self.size.add(len(jobs))
        first = jobs[0].delivery if jobs else None
        if first is not None:  # a batch is part of one take: its jobs share taken_at
            taken_at = first.taken_at
            self.wait.add_many([taken_at - job.activate_at for job in jobs])

    def write(self) -> None:
        self.outcomes["done"] += self.done
        self.done = 0
        for outcome, count in self.outcomes.items():
            if count:
                self.outcome_children[outcome].inc(count)
                self.outcomes[outcome] = 0
        self.duration.write_to(self.duration_child)
        self.size.write_to(self.size_child)
        self.wait.write_to(self.wait_child)


class _SlotMetrics:
    """A slot's metrics, written to the multiprocess files every METRICS_WRITE_INTERVAL_S.

    Writing after every batch cost a no-op handler's slot 6% of its CPU (each write
    takes a lock and touches an mmap'ed file); counting in plain Python and writing a
    few times a second costs it about 3% (``make bench``). The price: a slot killed with
    SIGKILL loses at most the last interval's figures.
    """

    def __init__(self, slot_label: str) -> None:
        self.slot_label = slot_label
        self.defs = metrics.slot_metrics()
        self._queues: dict[str, _QueueFigures] = {}
        self._next_write = time.monotonic() + METRICS_WRITE_INTERVAL_S

    def _for(self, queue: str) -> _QueueFigures:
        figures = self._queues.get(queue)
        if figures is None:
            figures = self._queues[queue] = _QueueFigures(self.defs, queue, self.slot_label)
        return figures

    def observe(self, queue: str, jobs: Sequence[Job], counters: BatchCounters) -> None:
        self._for(queue).add(jobs, counters)
        if time.monotonic() >= self._next_write:
            self.write()

    def write(self) -> None:
        """Write what was counted since the last write (also when idle and when stopping)."""
        for figures in self._queues.values():
            figures.write()
        self._next_write = time.monotonic() + METRICS_WRITE_INTERVAL_S

    def count_failures(self, queue: str, exception: str, jobs: int) -> None:
        """``jobs`` failed by an ``exception`` (a bounded label, see failure_report)."""
        self.defs.failures.labels(queue, exception).inc(jobs)

    def private_dirty(self, queue: str, value: int) -> None:
        self._for(queue).dirty_child.set(value)


def _drop_durability_note(record: logging.LogRecord) -> bool:
    return record.funcName != "_warn_once"


def _leave_durability_notes_to_the_master() -> None:
    """The broker's durability notes ("no persistence: a restart loses every job") are
    logged once by the master, not again by each slot it forks (a reload's template
    forks from a process that never logged them)."""
    logging.getLogger("qcluster.broker.redis_broker").addFilter(_drop_durability_note)


def run_slot(
    app: App,
    queue: str,
    *,
    broker_url: str | None,
    state_dir: Path,
    channel: Channel[MasterToSlot] | None = None,
    slot_no: int | None = None,
    burst: bool = False,
) -> int:
    """Serve ``queue`` until stopped; returns the process exit code.

    In a forked slot the broker connection is opened here, after the fork, never
    inherited from the master.
    """
    if slot_no is not None:
        metrics.use_slot_identity(slot_no)
    if channel is not None:
        _leave_durability_notes_to_the_master()
    try:
        broker = open_broker(broker_url, state_dir=state_dir)
    except BrokerError as exc:
        logger.error("slot: cannot open the broker: %s", exc)
        return exitcodes.BROKER_CONNECT
    runner = SlotRunner(app, queue, broker, channel=channel, slot_no=slot_no, burst=burst)
    return runner.run()
