"""The slot loop (shared/DESIGN.md section 3).

take a batch -> tell the master "batch started, deadline T" -> run the handler ->
settle the outcomes in one round trip -> counters -> now and then check our own
Private_Dirty -> obey master commands. Runs forked by the master (with a channel)
or in the foreground (``qcluster slot``).
"""

from __future__ import annotations

import logging
import math
import os
import random
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from qcluster import exitcodes, metrics, otel
from qcluster.app import App, QueueSpec, refuse_result
from qcluster.broker import Broker, Settlement
from qcluster.channel import Channel
from qcluster.errors import BrokerError
from qcluster.hooks import Failure
from qcluster.job import Delivery, Job
from qcluster.messages import (
    BatchCounters,
    BatchDone,
    BatchStarted,
    GaveBack,
    GiveBack,
    Heartbeat,
    MasterToSlot,
    Recycling,
    SlotHello,
    SlotRefused,
    StopSlot,
    SwitchQueue,
)
from qcluster.slot import identity
from qcluster.slot.aio import run_async_batch
from qcluster.slot.broker_outage import BrokerOutage
from qcluster.slot.broker_refusal import refused_for_good
from qcluster.slot.decode import decode_batch
from qcluster.slot.failure_report import FailureReporter
from qcluster.slot.give_back import give_back
from qcluster.slot.prefork import open_slot_broker
from qcluster.slot.settle import dead_retention, settle_batch
from qcluster.slot.slot_metrics import SlotMetrics
from qcluster.slot.take_progress import FollowedTake, TakeFollower, runs_each_job

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
#: Pause after a broker error before trying again (the client retries inside too).
BROKER_ERROR_PAUSE_S = 1.0


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
        self.outage = BrokerOutage()
        """The broker's failures, for what the log says of them."""
        self.burst = burst
        self.should_stop = False
        self.rand = random.Random()
        self.metrics = SlotMetrics(self.slot_label) if metrics.multiprocess_enabled() else None
        self.failures = FailureReporter(
            self.slot_label, identity.host, app.failure_hooks,
            count=self.metrics.count_failures if self.metrics else None)
        self._failed: list[Failure] = []
        """Failures of the batch that just ran, reported once it is done (a successful
        batch never fills it)."""
        self._last_sent = 0.0
        self._fast_batches = False
        self._batch_end = -math.inf
        """time.monotonic() at the last batch's handler return (-inf: none yet)."""
        self._one_at_a_time = False
        """The last take held suspect jobs: take one job at a time until a take has none
        (each suspect runs alone without re-reading its batch-mates every time)."""
        self._pending = Settlement()
        """Outcomes of the last batch, settled with the next take (see step)."""
        self._follower = TakeFollower(getattr(channel, "progress", None),
                                      settleable=broker.settles_for_others)
        """Follows each take in memory shared with the master (none: no master), which
        settles what a dead slot took, or only looks jobs up in it when the broker gives
        back a dead slot's jobs itself (RabbitMQ)."""
        self._take: FollowedTake | None = None
        """The take followed now; None: not followed."""
        self._per_job = runs_each_job(self.spec)
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
                line = self.outage.failed(str(exc), time.monotonic())
                if line:
                    logger.warning("slot %s on %s: %s", self.slot_label, self.queue, line)
                self._heartbeat(idle=True)  # waiting for the broker is not hung
                time.sleep(BROKER_ERROR_PAUSE_S)
                continue
            except Exception:  # a slot must never die of one bad job or reply
                logger.exception("slot %s: unexpected error on %s", self.slot_label, self.queue)
                self._heartbeat(idle=True)
                time.sleep(BROKER_ERROR_PAUSE_S)
                continue
            if self.outage.since is not None:
                logger.info("slot %s on %s: %s", self.slot_label, self.queue,
                            self.outage.answered(time.monotonic()))
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
        deliveries = self._settle_and_take()
        if not deliveries:
            self._follower.clear()  # the last take is settled: nothing held
            if self.metrics:
                self.metrics.write()
            self._heartbeat(idle=True)
            return False
        self._one_at_a_time = any(delivery.suspect for delivery in deliveries)
        if self._one_at_a_time:
            deliveries = self._one_suspect(deliveries)
        self._take = self._follower.begin(self.queue, deliveries, per_job=self._per_job)
        taken = time.monotonic()
        settlement = self._run_take(deliveries, taken)
        if self._failed:
            self._settle_then_report(settlement, taken, defer_settle=defer_settle)
        elif defer_settle:
            self._pending = settlement
        else:
            self.broker.settle(self.queue, settlement)
        return True

    def _settle_and_take(self) -> list[Delivery]:
        """Settle the last take's outcomes and take the next one, in one round trip where
        the backend can."""
        policy = self.spec.policy
        pending, self._pending = self._pending, Settlement()
        try:
            return self.broker.settle_and_take(
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

    def _run_take(self, deliveries: list[Delivery], taken: float) -> Settlement:
        """Run a take batch_size at a time; the outcomes of all its batches."""
        policy = self.spec.policy
        if not self._went_straight_on(deliveries[0], taken):
            self._batch_end = taken  # its first batch's seconds count from the take
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
            part, counters = self._run_batch(chunk, start)
            settlement.ack += part.ack
            settlement.postpone += part.postpone
            settlement.dead += part.dead
            settlement.refused += part.refused
            if part.errors:
                settlement.errors.update(part.errors)
            self._send(BatchDone(queue=self.queue, counters=counters))
        return settlement

    def _went_straight_on(self, oldest: Delivery, taken: float) -> bool:
        """The take's first (oldest) job was ready when the slot's last batch ended: the
        slot went straight from that batch to this take, and the seconds between (the
        round trip that settled it and took this one, the master's messages) are this
        take's first batch's. A take whose jobs came later may have waited for them: the
        slot was idle, and its batch counts from the take's return. On the broker's clock
        the last batch ended at least ``taken - self._batch_end`` before the take."""
        return oldest.activate_at <= oldest.taken_at - (taken - self._batch_end)

    def _settle_then_report(self, settlement: Settlement, taken: float, *,
                            defer_settle: bool) -> None:
        """A take where a handler raised: settle it at once (one more round trip, paid
        by failed takes only), then log and call the hooks. Settled first, the jobs'
        outcome never waits for a hook, and a slot killed while a hook runs holds
        nothing its master would have to give back."""
        try:
            self.broker.settle(self.queue, settlement)
            self._follower.clear()  # settled: nothing held
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
        policy = self.spec.policy
        self.broker.set_queue_options(self.queue, queue_type=policy.queue_type,
                                      max_attempts=policy.max_attempts)

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
        self, deliveries: Sequence[Delivery], first: int,
    ) -> tuple[Settlement, BatchCounters]:
        """Decode, run and settle one batch; ``first``: the index of its first delivery
        in the take."""
        jobs, rejected = decode_batch(deliveries, self.spec.policy)
        take = self._take
        if take is not None and jobs:
            jobs = take.running(jobs, deliveries, first)
        if not jobs:
            busy_s = 0.0
        elif otel.ENABLED and otel.active():  # traced: a span per batch and per job
            busy_s = otel.run_traced(self.queue, jobs, lambda: self._run_handler(jobs))
        else:
            busy_s = self._run_handler(jobs)
        # Prefetch only for handlers that finish fast: slow jobs are better spread
        # over every slot of the queue than queued behind each other in one.
        self._fast_batches = busy_s < PREFETCH_FAST_BATCH_S
        # The batch's seconds beside the handler's: what a batch costs beyond its handler
        # (the replay's batch_cost_s), one clock read a batch (see _went_straight_on).
        ended = time.monotonic()
        batch_s, self._batch_end = ended - self._batch_end, ended
        settlement, counters = settle_batch(
            jobs, self.spec.policy, rand=self.rand.random, rejected=rejected, busy_s=busy_s,
            batch_s=batch_s)
        if counters.done != len(jobs):  # some job did not simply succeed: any exception?
            self._failed += self.failures.collect(self.queue, jobs, settlement,
                                                  self.spec.policy, time.time())
        if take is not None and jobs:
            take.outcomes(jobs, deliveries, first, len(settlement.ack))
        if self.metrics:
            self.metrics.observe(self.queue, jobs, counters)
        return settlement, counters

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
                    refuse_result(result)
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
                try:
                    give_back(self.broker, self.app, command, rand=self.rand.random,
                              slot_label=self.slot_label)
                finally:
                    self._send(GaveBack(ref=command.ref))
            elif isinstance(command, SwitchQueue) and command.queue != self.queue:
                self._flush()  # outcomes belong to the old queue
                self._leave(self.queue)  # and its read-ahead jobs go back, unstarted
                self.spec = self.app.spec(command.queue)
                self._per_job = runs_each_job(self.spec)
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
        broker = open_slot_broker(broker_url, state_dir=state_dir)
    except BrokerError as exc:
        logger.error("slot: cannot open the broker: %s", exc)
        return exitcodes.BROKER_CONNECT
    runner = SlotRunner(app, queue, broker, channel=channel, slot_no=slot_no, burst=burst)
    return runner.run()
