"""The master's process side: fork slots, read their channels, watch, reap, reconcile.

One thread runs this loop (a selector over every slot channel plus a wake-up socket for
signals); the HTTP endpoint and the manager reporter run in their own threads and only
read :attr:`Supervisor.snapshot` or hand over a new desired row.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import selectors
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from master.capacity import CapacityLimits, HostSample, average_slot_pss, capacity
from master.probe import read_slot_memory, sample_host
from master.reconcile import Fork, LiveSlot, Stop, Switch, clip_to_capacity, plan_actions
from qcluster import exitcodes, metrics
from qcluster.app import App
from qcluster.channel import Channel, slot_channel_pair
from qcluster.config import Settings
from qcluster.messages import (
    BatchCounters,
    BatchDone,
    BatchStarted,
    Heartbeat,
    Recycling,
    SlotHello,
    SlotInfo,
    SlotState,
    SlotToMaster,
    StopSlot,
    SwitchQueue,
)

logger = logging.getLogger(__name__)

TICK_S = 1.0
SELECT_TIMEOUT_S = 0.2
MEMORY_PROBE_INTERVAL_S = 2.0
#: Crash backoff per queue: 0.5 s, 1 s, 2 s ... capped.
BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 60.0
PR_SET_PDEATHSIG = 1
RESTART_REASONS = ("recycle", "memory", "hung", "crash")


@dataclass
class Slot:
    slot_no: int
    pid: int
    queue: str
    channel: Channel[SlotToMaster]
    started_at: float
    started_mono: float
    last_seen: float
    state: SlotState = "starting"
    deadline: float | None = None
    jobs_done: int = 0
    pss_bytes: int = 0
    private_dirty_bytes: int = 0
    kill_reason: str | None = None
    stopping: bool = False

    def info(self) -> SlotInfo:
        return SlotInfo(
            slot_no=self.slot_no, pid=self.pid, queue=self.queue, state=self.state,
            started_at=self.started_at, jobs_done=self.jobs_done, pss_bytes=self.pss_bytes,
            private_dirty_bytes=self.private_dirty_bytes,
        )


@dataclass
class Snapshot:
    """What other threads may read: replaced as a whole every tick."""

    slots: list[SlotInfo] = field(default_factory=list)
    last_seen: dict[int, float] = field(default_factory=dict)
    sample: HostSample | None = None
    capacity_slots: int = 0
    avg_slot_pss_bytes: int = 0
    restarts: dict[tuple[str, str], int] = field(default_factory=dict)
    desired: dict[str, int] = field(default_factory=dict)


def set_parent_death_signal() -> None:
    """Ask the kernel to SIGKILL this process when its parent (the master) dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class Supervisor:
    """Keeps this host's slots equal to the desired row, clipped to capacity."""

    def __init__(
        self, app: App, settings: Settings, *, host_name: str,
        fixed_row: dict[str, int] | None, run_slot: Callable[..., int],
    ) -> None:
        self.app = app
        self.settings = settings
        self.host_name = host_name
        self.run_slot = run_slot
        self.limits = CapacityLimits(
            reserve_bytes=int(settings.master.reserve_mb * (1 << 20)),
            slot_pss_estimate_bytes=int(settings.master.slot_pss_estimate_mb * (1 << 20)),
            max_load_per_cpu=settings.master.max_load_per_cpu,
            max_slots=settings.master.max_slots,
        )
        self.row: dict[str, int] = fixed_row if fixed_row is not None else self.default_row()
        self.slots: dict[int, Slot] = {}
        self.restarts: Counter[tuple[str, str]] = Counter()
        self.crash_streak: Counter[str] = Counter()
        self.fork_after: dict[str, float] = {}
        self.pending: dict[str, BatchCounters] = {}
        self.lock = threading.Lock()
        self.snapshot = Snapshot()
        self.stopping = False
        self.forced = False
        self.extra_fds: list[int] = []
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._capacity = 0
        self._next_probe = 0.0
        self._hangups = 0

    # --- the desired row -------------------------------------------------------

    def default_row(self) -> dict[str, int]:
        """--host-auto without a manager: each queue's minimum, or one slot each."""
        specs = {name: self.app.spec(name).policy for name in self.app.queues}
        if any(policy.min_slots for policy in specs.values()):
            return {name: policy.min_slots for name, policy in specs.items()}
        return dict.fromkeys(specs, 1)

    def set_row(self, row: dict[str, int]) -> None:
        """Called by the reporter thread with the manager's row (unknown queues dropped)."""
        known = set(self.app.queues)
        with self.lock:
            self.row = {queue: n for queue, n in row.items() if queue in known}

    def take_counters(self) -> dict[str, BatchCounters]:
        with self.lock:
            pending, self.pending = self.pending, {}
        return pending

    # --- lifecycle -------------------------------------------------------------

    def run(self) -> int:
        self._install_signals()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        next_tick = 0.0
        while True:
            for key, _ in self._selector.select(self._select_timeout(time.monotonic())):
                if key.fileobj is self._wake_r:
                    with contextlib.suppress(BlockingIOError):
                        self._wake_r.recv(4096)
                else:
                    self._on_messages(key.data)
            self._reap()
            now = time.monotonic()
            self._kill_overdue(now)
            self._log_hangups()
            if now >= next_tick:
                next_tick = now + TICK_S
                self.tick(now)
            if self.stopping and (not self.slots or self.forced):
                return self._finish()

    def _select_timeout(self, now: float) -> float:
        """Wake at the nearest batch deadline, not on the next tick: a hung slot must be
        killed before its jobs' locks expire (the policy's kill margin is all it has)."""
        deadlines = [s.deadline for s in self.slots.values()
                     if s.deadline is not None and not s.kill_reason]
        if not deadlines:
            return SELECT_TIMEOUT_S
        return max(0.0, min(SELECT_TIMEOUT_S, min(deadlines) - now))

    def _kill_overdue(self, now: float) -> None:
        for slot in list(self.slots.values()):
            if slot.deadline is not None and now >= slot.deadline:
                self._kill(slot, "hung")

    def _log_hangups(self) -> None:
        if self._hangups:
            logger.warning("SIGHUP received (%d): ignored, there is no reload yet; "
                           "SIGTERM stops the master", self._hangups)
            self._hangups = 0

    def tick(self, now: float) -> None:
        self._probe(now)
        self._watch(now)
        if not self.stopping:
            self._reconcile(now)
        self._publish_snapshot()

    def _install_signals(self) -> None:
        self._wake_w.setblocking(False)
        self._wake_r.setblocking(False)
        signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, self._on_stop_signal)
        signal.signal(signal.SIGINT, self._on_stop_signal)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the selector
        signal.signal(signal.SIGHUP, self._on_hangup)

    def _on_hangup(self, signum: int, frame: FrameType | None) -> None:
        """Only counted here (the loop logs it): a handler must not take the log's lock."""
        self._hangups += 1

    def _on_stop_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.stopping:
            logger.warning("second stop signal: killing every slot now")
            self.forced = True
            self._kill_all()
            return
        logger.info("stopping: every slot finishes and settles its batch (Ctrl-C again forces)")
        self.stopping = True
        self._stop_deadline = time.monotonic() + self.settings.master.graceful_timeout_s
        for slot in self.slots.values():
            self._stop(slot)

    def _finish(self) -> int:
        self._kill_all()
        while self.slots:
            self._reap(block=True)
        return exitcodes.OK

    def _kill_all(self) -> None:
        for slot in self.slots.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(slot.pid, signal.SIGKILL)

    # --- slots -----------------------------------------------------------------

    def _free_slot_no(self) -> int:
        used = set(self.slots)
        return next(n for n in range(len(used) + 1) if n not in used)

    def fork(self, queue: str) -> Slot:
        slot_no = self._free_slot_no()
        master_end, slot_end = slot_channel_pair()
        master_pid = os.getpid()
        pid = os.fork()
        if pid == 0:  # the slot
            code = exitcodes.FAILURE
            try:
                master_end.close()
                code = self._become_slot(master_pid, queue, slot_no, slot_end)
            finally:
                os._exit(code)
        slot_end.close()
        now = time.monotonic()
        slot = Slot(slot_no, pid, queue, master_end, time.time(), now, now)
        self.slots[slot_no] = slot
        self._selector.register(master_end.sock, selectors.EVENT_READ, slot)
        logger.info("slot %d (pid %d) started on %s", slot_no, pid, queue)
        return slot

    def _become_slot(
        self, master_pid: int, queue: str, slot_no: int, channel: Channel[Any]
    ) -> int:
        set_parent_death_signal()
        if os.getppid() != master_pid:  # the master died before prctl took effect
            return exitcodes.FAILURE
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closed terminal stops no batch
        self._selector.close()
        for other in self.slots.values():
            other.channel.sock.close()
        for fd in (self._wake_r.fileno(), self._wake_w.fileno(), *self.extra_fds):
            with contextlib.suppress(OSError):
                os.close(fd)
        return int(self.run_slot(
            self.app, queue, broker_url=self.settings.broker_url,
            state_dir=self.settings.state_dir, channel=channel, slot_no=slot_no,
        ))

    def _stop(self, slot: Slot) -> None:
        if slot.stopping:
            return
        slot.stopping = True
        slot.state = "stopping"
        slot.channel.send(StopSlot())
        with contextlib.suppress(ProcessLookupError):
            os.kill(slot.pid, signal.SIGTERM)

    def _kill(self, slot: Slot, reason: str) -> None:
        if slot.kill_reason:
            return
        logger.warning("slot %d (pid %d, %s): SIGKILL, %s", slot.slot_no, slot.pid,
                       slot.queue, reason)
        slot.kill_reason = reason
        with contextlib.suppress(ProcessLookupError):
            os.kill(slot.pid, signal.SIGKILL)

    def _on_messages(self, slot: Slot) -> None:
        now = time.monotonic()
        for message in slot.channel.receive():
            slot.last_seen = now
            self._apply(slot, message)

    def _apply(self, slot: Slot, message: SlotToMaster) -> None:
        if isinstance(message, BatchStarted):
            slot.state, slot.deadline = "busy", message.deadline_mono
        elif isinstance(message, BatchDone):
            slot.state, slot.deadline = "idle", None
            slot.jobs_done += message.counters.processed
            self.crash_streak.pop(slot.queue, None)
            with self.lock:
                before = self.pending.get(message.queue, BatchCounters())
                self.pending[message.queue] = before + message.counters
        elif isinstance(message, Heartbeat):
            if not slot.stopping:
                slot.state = "idle" if message.idle else slot.state
            slot.queue = message.queue
        elif isinstance(message, SlotHello):
            slot.state = "idle"
        elif isinstance(message, Recycling):
            slot.private_dirty_bytes = message.private_dirty_bytes

    def _reap(self, block: bool = False) -> None:
        while self.slots:
            try:
                pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            slot = next((s for s in self.slots.values() if s.pid == pid), None)
            if slot is not None:
                self._ended(slot, os.waitstatus_to_exitcode(status))
            if block:
                return

    def _ended(self, slot: Slot, code: int) -> None:
        del self.slots[slot.slot_no]
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(slot.channel.sock)
        slot.channel.close()
        metrics.mark_slot_dead(slot.slot_no)
        reason = self._restart_reason(slot, code)
        logger.info("slot %d (pid %d, %s) exited with %d%s", slot.slot_no, slot.pid,
                    slot.queue, code, f": restart ({reason})" if reason else "")
        if reason is None:
            return
        self.restarts[(slot.queue, reason)] += 1
        if reason == "crash":
            self.crash_streak[slot.queue] += 1
            delay = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** (self.crash_streak[slot.queue] - 1))
            self.fork_after[slot.queue] = time.monotonic() + delay

    def _restart_reason(self, slot: Slot, code: int) -> str | None:
        if slot.kill_reason:
            return slot.kill_reason
        if code == exitcodes.RECYCLE:
            return "recycle"
        if self.stopping or (slot.stopping and code == exitcodes.OK):
            return None
        return "crash" if code != exitcodes.OK else None

    # --- watch and reconcile ---------------------------------------------------

    def _probe(self, now: float) -> None:
        if now < self._next_probe:
            return
        self._next_probe = now + MEMORY_PROBE_INTERVAL_S
        memory = read_slot_memory(s.pid for s in self.slots.values())
        for slot in self.slots.values():
            sample = memory.get(slot.pid)
            if sample is not None:
                slot.pss_bytes = sample.pss_bytes
                slot.private_dirty_bytes = sample.private_dirty_bytes
        host = sample_host(memory.values())
        self._sample = host
        self._capacity = capacity(host, self.limits)

    def _watch(self, now: float) -> None:
        timeout = self.settings.master.heartbeat_timeout_s
        for slot in list(self.slots.values()):
            past_deadline = slot.deadline is not None and now > slot.deadline
            silent = slot.deadline is None and now - slot.last_seen > timeout
            if past_deadline or silent:
                self._kill(slot, "hung")
            elif self._far_over_memory(slot):
                self._kill(slot, "memory")
        if self.stopping and now > getattr(self, "_stop_deadline", now + 1):
            self._kill_all()

    def _far_over_memory(self, slot: Slot) -> bool:
        limit_mb = self.app.spec(slot.queue).policy.private_dirty_limit_mb
        limit = limit_mb * (1 << 20) * self.settings.master.memory_kill_factor
        return slot.private_dirty_bytes > limit

    def _priorities(self) -> dict[str, int]:
        return {name: self.app.spec(name).policy.priority for name in self.app.queues}

    def _reconcile(self, now: float) -> None:
        with self.lock:
            row = dict(self.row)
        desired = clip_to_capacity(row, self._capacity or len(self.slots), self._priorities())
        live = [LiveSlot(s.slot_no, s.queue, s.state in ("idle", "starting"), s.stopping)
                for s in self.slots.values()]
        for action in plan_actions(desired, live):
            if isinstance(action, Fork):
                if now >= self.fork_after.get(action.queue, 0.0):
                    self.fork(action.queue)
            elif isinstance(action, Stop):
                self._stop(self.slots[action.slot_no])
            elif isinstance(action, Switch):
                slot = self.slots[action.slot_no]
                if slot.channel.send(SwitchQueue(queue=action.queue)):
                    slot.queue = action.queue
        self._desired = desired

    def _publish_snapshot(self) -> None:
        sample = getattr(self, "_sample", None)
        self.snapshot = Snapshot(
            slots=[s.info() for s in sorted(self.slots.values(), key=lambda s: s.slot_no)],
            last_seen={s.slot_no: time.time() - (time.monotonic() - s.last_seen)
                       for s in self.slots.values()},
            sample=sample,
            capacity_slots=self._capacity,
            avg_slot_pss_bytes=average_slot_pss(sample, self.limits) if sample else 0,
            restarts=dict(self.restarts),
            desired=dict(getattr(self, "_desired", {})),
        )
