"""A slot's life as a pure state machine: its state, what a message or an exit does to it,
and the per-queue restart backoff that ends in a reported fatal state.

No clock, no I/O: every function takes ``now`` (monotonic seconds) and returns what
changed; the supervisor does the forking, signalling and logging.

::

    starting --hello--> idle <--batch done-- busy
        |                 |  --batch started-->  |
        +------ stop -----+------> stopping <----+
    any state --exit--> (gone): decode_exit() says why, RestartBackoff says when again
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from qcluster import exitcodes
from qcluster.messages import (
    BatchCounters,
    BatchDone,
    BatchStarted,
    GiveBack,
    Heartbeat,
    Recycling,
    SlotHello,
    SlotInfo,
    SlotRefused,
    SlotState,
    SlotToMaster,
)

RestartReason = Literal["recycle", "memory", "hung", "crash", "boot_error"]
#: Every reason, in the order the metric lists them.
RESTART_REASONS: tuple[RestartReason, ...] = ("recycle", "memory", "hung", "crash", "boot_error")
KillReason = Literal["memory", "hung"]

#: Restart backoff per queue after a crash or a boot error: 0.5 s, 1 s, 2 s ... capped.
BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 60.0
#: Consecutive boot errors (exit 3 or 4) after which a queue is fatal: not forked again
#: until the master restarts (a missing handler does not fix itself).
BOOT_ERROR_LIMIT = 5
BOOT_ERROR_CODES = frozenset({exitcodes.BOOT_ERROR, exitcodes.APP_IMPORT})
#: How a slot told to stop ends cleanly: it exits 0, or SIGTERM's default action ends it
#: while it boots (its handler is installed when it starts serving; it holds no take yet).
#: (-15: SIGTERM on Linux, spelt out: this module is pure, it imports no signal.)
STOPPED_CODES = frozenset({exitcodes.OK, -15})


@dataclass
class SlotRecord:
    """One forked slot as the master knows it (the process is the effects layer's)."""

    slot_no: int
    pid: int
    queue: str
    started_at: float
    """Wall-clock unix seconds (shown to people)."""
    started_mono: float
    """Monotonic seconds (every duration is measured from this)."""
    last_seen: float
    state: SlotState = "starting"
    reason: str = "forked"
    """Why the slot is in its state (the last transition)."""
    deadline: float | None = None
    jobs_done: int = 0
    pss_bytes: int = 0
    private_dirty_bytes: int = 0
    kill_reason: KillReason | None = None
    generation: int = 0
    """The code it was forked with: 0 the master's own, N the Nth reload template's."""
    refused: str = ""
    """Why the broker refused the slot's queue for good (messages.SlotRefused)."""

    @property
    def stopping(self) -> bool:
        return self.state == "stopping"

    def move(self, state: SlotState, reason: str) -> None:
        self.state, self.reason = state, reason

    def info(self, take: int | None = None) -> SlotInfo:
        return SlotInfo(
            slot_no=self.slot_no, pid=self.pid, queue=self.queue, state=self.state,
            started_at=self.started_at, jobs_done=self.jobs_done, pss_bytes=self.pss_bytes,
            private_dirty_bytes=self.private_dirty_bytes, take=take,
        )


def on_message(slot: SlotRecord, message: SlotToMaster, now: float) -> BatchCounters | None:
    """Apply one message from the slot; returns the counters of a finished batch."""
    slot.last_seen = now
    if isinstance(message, BatchStarted):
        if not slot.stopping:
            slot.move("busy", "batch started")
        slot.deadline = message.deadline_mono
    elif isinstance(message, BatchDone):
        if not slot.stopping:
            slot.move("idle", "batch done")
        slot.deadline = None
        slot.jobs_done += message.counters.processed
        return message.counters
    elif isinstance(message, Heartbeat):
        if message.idle and not slot.stopping:
            slot.move("idle", "heartbeat")
        slot.queue = message.queue
    elif isinstance(message, SlotHello):
        if not slot.stopping:
            slot.move("idle", "hello")
    elif isinstance(message, Recycling):
        slot.private_dirty_bytes = message.private_dirty_bytes
    elif isinstance(message, SlotRefused):
        slot.refused = message.reason
    return None


def decode_exit(
    slot: SlotRecord, code: int, *, master_stopping: bool
) -> RestartReason | None:
    """Why the ended slot is restarted (its restart reason), or None when it is not.

    ``code`` is ``os.waitstatus_to_exitcode``'s: negative for a signal."""
    if slot.kill_reason:
        return slot.kill_reason
    if code == exitcodes.RECYCLE:
        return "recycle"
    if master_stopping or (slot.stopping and code in STOPPED_CODES):
        return None
    if code in BOOT_ERROR_CODES or code == exitcodes.BROKER_REFUSED:
        return "boot_error"
    return "crash" if code != exitcodes.OK else None


@dataclass
class RestartBackoff:
    """When each queue may fork again after crashes and boot errors; which queues are fatal."""

    base_s: float = BACKOFF_BASE_S
    max_s: float = BACKOFF_MAX_S
    boot_error_limit: int = BOOT_ERROR_LIMIT
    streak: dict[str, int] = field(default_factory=dict)
    boot_errors: dict[str, int] = field(default_factory=dict)
    fork_after: dict[str, float] = field(default_factory=dict)
    fatal: dict[str, str] = field(default_factory=dict)
    """Queue -> why it is no longer forked."""

    def on_restart(self, queue: str, reason: RestartReason, now: float,
                   refused: str = "") -> str | None:
        """Record an ended slot; returns the fatal message when the queue just became fatal
        (at once when the broker ``refused`` the queue: no retry can fix it)."""
        if refused and queue not in self.fatal:
            self.fatal[queue] = (f"the broker refused it: {refused} (not forked again until "
                                 "the master restarts)")
            return self.fatal[queue]
        if reason not in ("crash", "boot_error"):
            return None
        self.streak[queue] = self.streak.get(queue, 0) + 1
        self.fork_after[queue] = now + self.delay_s(self.streak[queue])
        if reason == "boot_error":
            self.boot_errors[queue] = self.boot_errors.get(queue, 0) + 1
            if self.boot_errors[queue] >= self.boot_error_limit and queue not in self.fatal:
                self.fatal[queue] = (f"{self.boot_errors[queue]} boot errors in a row: "
                                     "not forked again until the master restarts")
                return self.fatal[queue]
        return None

    def on_booted(self, queue: str) -> None:
        """A slot of the queue said hello: it can boot."""
        self.boot_errors.pop(queue, None)

    def on_batch_done(self, queue: str) -> None:
        """A completed batch: the queue is healthy, the next crash waits the base delay."""
        self.streak.pop(queue, None)
        self.boot_errors.pop(queue, None)

    def delay_s(self, streak: int) -> float:
        return min(self.max_s, self.base_s * 2 ** (streak - 1))

    def may_fork(self, queue: str, now: float) -> bool:
        return queue not in self.fatal and now >= self.fork_after.get(queue, 0.0)

    def next_fork_at(self, now: float) -> float | None:
        """The nearest moment a queue waiting on its backoff may fork again."""
        waiting = [at for queue, at in self.fork_after.items()
                   if at > now and queue not in self.fatal]
        return min(waiting, default=None)


#: Restart reasons after which a slot's take may be unsettled (it died or was killed).
DIED = frozenset({"crash", "hung", "memory"})


def death(slot: SlotRecord, reason: RestartReason, code: int) -> str:
    """How a slot that died holding jobs ended, in words for their last error.

    ``code`` is ``os.waitstatus_to_exitcode``'s: negative for a signal."""
    if reason == "hung":
        if slot.deadline is not None:
            return "killed: its batch ran past the queue's batch_timeout"
        return "killed: it sent the master nothing for heartbeat_timeout"
    if reason == "memory":
        return "killed: its private memory grew far over the queue's private_dirty_limit_mb"
    return f"it exited with {code}" if code >= 0 else f"it was killed by signal {-code}"


def give_back(reason: RestartReason | None, taken: GiveBack | None) -> GiveBack | None:
    """What to settle for a slot that ended: the take its TakeProgress followed
    (``taken``), when the slot died (``reason``) rather than exited on its own (then it
    settled its take itself)."""
    return taken if reason in DIED else None
