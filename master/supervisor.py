"""The master's loop: observe -> decide -> act, one pass per wake-up.

* observe: queued signals, the slots' messages, ended children, the host probe;
* decide: the pure parts (``slots.py`` transitions and exit decoding, ``watch.py``
  verdicts, ``reconcile.py`` actions, ``capacity.py``);
* act: ``effects.py`` forks, signals and reaps; the snapshot is republished.

One thread runs this loop; it sleeps until a slot speaks, a signal arrives or the nearest
deadline (a batch deadline, a backoff's end, the next probe, at most ``TICK_S``). The HTTP
endpoint and the reporter run in their own threads and only read :attr:`snapshot`, take
:attr:`counters` or hand over a new desired row.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Collection

from qcluster import exitcodes
from qcluster.app import App
from qcluster.channel import Channel
from qcluster.config import Settings
from qcluster.master.capacity import CapacityLimits, capacity
from qcluster.master.counters import MasterCounters
from qcluster.master.effects import ProcessEffects, become_subreaper
from qcluster.master.pool import SlotPool
from qcluster.master.probe import read_slot_memory, sample_host
from qcluster.master.reconcile import clip_to_capacity
from qcluster.master.reload import CodeSource, Reloader
from qcluster.master.rollout import plan_pass
from qcluster.master.slots import SlotRecord
from qcluster.master.snapshot import HostReading, SupervisorSnapshot, build_snapshot
from qcluster.master.template import TemplateSpec
from qcluster.master.watch import WatchLimits, dirty_kill_bytes, next_deadline, verdict, wake_in
from qcluster.messages import BatchCounters, MasterToSlot
from qcluster.policy import QueuePolicy

logger = logging.getLogger(__name__)

TICK_S = 1.0
"""The longest the loop sleeps: silence, a failed switch and the row are looked at again."""
MEMORY_PROBE_INTERVAL_S = 2.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
DEFAULT_POLICY = QueuePolicy.model_validate({})


def capacity_limits(settings: Settings) -> CapacityLimits:
    master = settings.master
    return CapacityLimits(
        reserve_bytes=int(master.reserve_mb * (1 << 20)),
        slot_pss_estimate_bytes=int(master.slot_pss_estimate_mb * (1 << 20)),
        max_load_per_cpu=master.max_load_per_cpu, max_slots=master.max_slots)


def default_row(app: App) -> dict[str, int]:
    """Without a manager and --slots: each queue's minimum, or one slot each."""
    specs = {name: app.spec(name).policy for name in app.queues}
    if any(policy.min_slots for policy in specs.values()):
        return {name: policy.min_slots for name, policy in specs.items()}
    return dict.fromkeys(specs, 1)


class HostProbe:
    """The host's memory and capacity and each slot's memory, read every
    ``MEMORY_PROBE_INTERVAL_S``."""

    def __init__(self, limits: CapacityLimits) -> None:
        self.reading = HostReading(None, 0, limits)
        self.next_at = 0.0

    def poll(self, now: float, slots: Collection[SlotRecord]) -> bool:
        """Read the host and the slots when due; True when read."""
        if now < self.next_at:
            return False
        self.next_at = now + MEMORY_PROBE_INTERVAL_S
        memory = read_slot_memory(s.pid for s in slots)
        for slot in slots:
            if (sample := memory.get(slot.pid)) is not None:
                slot.pss_bytes = sample.pss_bytes
                slot.private_dirty_bytes = sample.private_dirty_bytes
        host = sample_host(memory.values())
        self.reading = HostReading(host, capacity(host, self.reading.limits), self.reading.limits)
        return True


class GracefulStop:
    """The master's stop: every slot finishes and settles its batch, until
    ``graceful_timeout_s`` or a second stop signal kills what is left."""

    def __init__(self, pool: SlotPool, reload: Reloader, timeout_s: float) -> None:
        self.pool, self.reload, self.timeout_s = pool, reload, timeout_s
        self.requested = self.forced = False
        self.deadline: float | None = None

    def on_signal(self, now: float) -> None:
        if self.requested:
            logger.warning("second stop signal: killing every slot now")
            self.forced = True
            self.pool.kill_all()
            return
        logger.info("stopping: every slot finishes and settles its batch "
                    "(Ctrl-C again forces)")
        self.requested = True
        self.reload.shutdown()
        self.deadline = now + self.timeout_s
        for slot in list(self.pool.slots.values()):
            self.pool.stop(slot, "master stopping")

    def kill_if_late(self, now: float) -> None:
        if self.deadline is not None and now > self.deadline:
            self.pool.kill_all()

    def next_at(self, now: float) -> float | None:
        """The deadline while it is ahead (the loop wakes then)."""
        return self.deadline if (self.deadline or 0.0) > now else None

    def done(self) -> bool:
        """Every slot ended (or the stop was forced): the master may exit."""
        return self.requested and (not self.pool.slots or self.forced)


class Supervisor:
    """Keeps this host's slots equal to the desired row, clipped to capacity."""

    def __init__(self, app: App, settings: Settings, *, host_name: str,
                 fixed_row: dict[str, int] | None, run_slot: Callable[..., int],
                 effects: ProcessEffects | None = None, version: str = "",
                 template_spec: TemplateSpec | None = None) -> None:
        self.app, self.settings, self.host_name, self.run_slot = app, settings, host_name, run_slot
        self.row = fixed_row if fixed_row is not None else default_row(app)
        self.counters = MasterCounters()
        self.effects = effects or ProcessEffects()
        self.extra_fds = self.effects.extra_fds
        self.effects.tend = self._tend
        self.pool = SlotPool(self.effects, self.counters, self._slot_main, lambda: time.time())
        self.probe = HostProbe(capacity_limits(settings))
        self.watch_limits = WatchLimits(settings.master.heartbeat_timeout_s,
                                        settings.master.memory_kill_factor)
        self.snapshot = SupervisorSnapshot()
        self._row_lock = threading.Lock()
        self._due_at = 0.0
        """When the loop must decide again without a new event (tick, backoff end, stop)."""
        self._desired: dict[str, int] = {}
        base = CodeSource(0, version, {name: q.policy for name, q in app.queues.items()})
        spec = template_spec or TemplateSpec(app=settings.app or "", master_pid=0,
                                             broker_url=settings.broker_url,
                                             state_dir=str(settings.state_dir))
        self.reload = Reloader(self.pool, base, spec, self._row_queues)
        self.stop = GracefulStop(self.pool, self.reload, settings.master.graceful_timeout_s)

    @property
    def stopping(self) -> bool:
        """A stop signal came (read by the reporter thread too)."""
        return self.stop.requested

    def set_row(self, row: dict[str, int]) -> None:
        """Called by the reporter thread with the manager's row (unknown queues dropped)."""
        with self._row_lock:
            known = self.reload.code.policies()
            self.row = {queue: n for queue, n in row.items() if queue in known}
        self._due_at = 0.0  # decided at the loop's next wake-up (within TICK_S)

    def set_reload_id(self, reload_id: str) -> None:
        """Called by the reporter thread with the manager's Assignment.reload_id."""
        self.reload.offer_reload_id(reload_id)
        self._due_at = 0.0

    def take_counters(self) -> dict[str, BatchCounters]:
        return self.counters.take()

    def on_signal(self, signum: int, frame: object) -> None:
        self.effects.queue_signal(signum, frame)

    def run(self) -> int:
        become_subreaper()  # slots a reload template forks are reparented to the master
        self.effects.install_signals()
        while True:
            code = self.step(time.monotonic())
            if code is not None:
                return code

    def step(self, now: float, *, block: bool = True) -> int | None:
        """One pass; returns the exit code once the master is done. ``block``: first sleep
        until something happens or the nearest deadline."""
        ready = self.effects.channels.wait(self._wake_in(now) if block else 0.0)
        now = time.monotonic() if block else now
        changed = self._observe(now, ready)
        deadline = next_deadline(self.pool.slots.values())
        if changed or now >= self._due_at or (deadline is not None and now >= deadline):
            self._decide_and_act(now)
        if self.stop.done():
            self.pool.bury_all(now)
            return exitcodes.OK
        return None

    def _wake_in(self, now: float) -> float:
        moments = (next_deadline(self.pool.slots.values()), self._due_at, self.probe.next_at)
        return wake_in(now, moments, TICK_S)

    def publish(self, now: float) -> None:
        """Replace the snapshot the other threads read (after every decision, so at least
        every ``TICK_S``; a pass that only applied slot messages does not publish)."""
        self.snapshot = build_snapshot(
            self.pool.slots.values(), self.probe.reading, restarts=self.counters.restarts(),
            desired=self._desired, fatal=self.pool.backoff.fatal, wall_now=time.time(),
            mono_now=now, code=self.reload.info(), reloads=dict(self.reload.results),
            takes=self.pool.channels.takes())

    def _row_queues(self) -> list[str]:
        with self._row_lock:
            return sorted(self.row)

    def _slot_main(self, queue: str, slot_no: int, channel: Channel[MasterToSlot]) -> int:
        """What a forked slot runs (in the child)."""
        return int(self.run_slot(self.app, queue, broker_url=self.settings.broker_url,
                                 state_dir=self.settings.state_dir, channel=channel,
                                 slot_no=slot_no))

    # --- observe ---------------------------------------------------------------

    def _observe(self, now: float, ready: list[int]) -> bool:
        """Signals, messages, ended children, the probe. True when more than messages came
        (messages alone are applied without a decision: they come with every batch)."""
        changed = bool(self.effects.signals)
        while self.effects.signals:
            self._on_signal(self.effects.signals.popleft(), now)
        for pid in ready:
            self.pool.receive(pid, now)
        changed |= self.pool.reap(now, master_stopping=self.stopping) > 0
        changed |= not self.stopping and self.reload.observe(now)
        changed |= self.probe.poll(now, self.pool.slots.values())
        return changed

    def _on_signal(self, signum: int, now: float) -> None:
        if signum == signal.SIGHUP and not self.stopping:
            self.reload.start("SIGHUP", now)
        elif signum in STOP_SIGNALS:
            self.stop.on_signal(now)

    # --- decide and act --------------------------------------------------------

    def _decide_and_act(self, now: float) -> None:
        self._kill_due(now)
        if not self.stopping:
            self._reconcile(now)
        self.publish(now)
        self._due_at = min(m for m in (now + TICK_S, self.pool.backoff.next_fork_at(now),
                                       self.stop.next_at(now)) if m is not None)

    def _kill_due(self, now: float) -> None:
        """SIGKILL the slots past their batch deadline or far over their memory, and every
        slot once a stop's grace time is over."""
        policies = self.reload.code.policies()
        for slot in list(self.pool.slots.values()):
            limit_mb = policies.get(slot.queue, DEFAULT_POLICY).private_dirty_limit_mb
            kill_bytes = dirty_kill_bytes(limit_mb, self.watch_limits)
            if (reason := verdict(slot, now, self.watch_limits, kill_bytes)) is not None:
                self.pool.kill(slot, reason)
        self.stop.kill_if_late(now)

    def _tend(self) -> float | None:
        """While a reload template forks a slot (effects.tend): the kills due by now, so a
        stalled template delays none; returns when the next one is due."""
        now = time.monotonic()
        self._kill_due(now)
        moments = (next_deadline(self.pool.slots.values()), self.stop.next_at(now))
        return min((m for m in moments if m is not None), default=None)

    def _reconcile(self, now: float) -> None:
        fatal = self.pool.backoff.fatal
        with self._row_lock:
            row = {queue: n for queue, n in self.row.items() if queue not in fatal}
        priorities = {name: p.priority for name, p in self.reload.code.serving.policies.items()}
        capacity_slots = self.probe.reading.capacity_slots or len(self.pool.slots)
        self._desired = clip_to_capacity(row, capacity_slots, priorities)
        self.pool.apply(plan_pass(self._desired, self.pool.live(), self.pool.generation), now)
        self.reload.after_pass()
