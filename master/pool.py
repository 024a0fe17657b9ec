"""This host's slots and what the master does to them: fork, stop, kill, receive, bury.

The pool keeps each slot's :class:`~qcluster.master.slots.SlotRecord` (the pure state
machine decides its transitions) and goes through :class:`ProcessEffects` for every
effect on a process (its :class:`SlotChannels` for messages); restarts and job counters go
to :class:`MasterCounters`; :class:`GiveBacks` keeps dead slots' takes until a live slot
settles them.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from qcluster import metrics
from qcluster.master.counters import MasterCounters
from qcluster.master.effects import ProcessEffects, SlotChannels, SlotMain
from qcluster.master.reconcile import Action, Fork, LiveSlot, Stop, Switch
from qcluster.master.slots import (
    KillReason,
    RestartBackoff,
    RestartReason,
    SlotRecord,
    death,
    decode_exit,
    give_back,
    on_message,
)
from qcluster.messages import (
    BatchDone,
    GaveBack,
    GiveBack,
    Progress,
    SlotHello,
    StopSlot,
    SwitchQueue,
)
from qcluster.slot.prefork import clear_type_cache

#: Give-back parts kept while no live slot can take them (older ones are dropped: their
#: jobs come back when their locks expire, as without a master).
MAX_PENDING_GIVE_BACKS = 256
#: Which live slot settles a dead one's jobs first (an idle one answers soonest).
_GIVE_BACK_ORDER = {"idle": 0, "busy": 1, "starting": 2}

if TYPE_CHECKING:
    from qcluster.master.template import Template

logger = logging.getLogger(__name__)
#: Called with a slot that said hello; with one that ended, its restart reason and code.
OnHello = Callable[[SlotRecord], None]
OnEnded = Callable[[SlotRecord, RestartReason | None, int], None]
#: Called with a child that was no slot (a reload template; an orphan adopted as reaper).
OnOtherChild = Callable[[int, int], None]


class SlotPool:
    def __init__(self, effects: ProcessEffects, counters: MasterCounters,
                 slot_main: SlotMain, clock: Callable[[], float] = time.time) -> None:
        self.effects = effects
        self.channels = effects.channels
        self.counters = counters
        self.backoff = RestartBackoff()
        self.slots: dict[int, SlotRecord] = {}
        self._slot_main = slot_main
        self._wall_clock = clock
        self.give_backs = GiveBacks(self.channels)
        self.template: Template | None = None
        """Where slots are forked from: None the master itself, else a reload template."""
        self.generation = 0
        """The generation new slots get (see master/reload.py)."""
        self.serving_generations: set[int] = {0}
        """Generations the rollout leaves alone: ``generation``, and a dead template's
        whose slots serve on while new ones come from older code."""
        self.on_hello: OnHello = lambda slot: None
        self.on_ended: OnEnded = lambda slot, reason, code: None
        self.on_other_child: OnOtherChild = lambda pid, code: None

    def slot_of(self, pid: int) -> SlotRecord | None:
        return next((s for s in self.slots.values() if s.pid == pid), None)

    def is_current(self, slot: SlotRecord) -> bool:
        """Not to be replaced by a rollout (see ``serving_generations``)."""
        return slot.generation in self.serving_generations

    def live(self) -> list[LiveSlot]:
        """The slots as the reconcile step sees them (a current one as of ``generation``)."""
        return [LiveSlot(s.slot_no, s.queue, s.state in ("idle", "starting"), s.stopping,
                         self.generation if self.is_current(s) else s.generation,
                         s.state == "starting")
                for s in self.slots.values()]

    def apply(self, actions: Sequence[Action], now: float) -> None:
        emptied = self.template is not None  # (a template's slots are forked from its cache)
        for action in actions:
            if isinstance(action, Fork) and self.backoff.may_fork(action.queue, now):
                if not emptied:  # once per pass, before its first fork: see clear_type_cache
                    clear_type_cache()
                    emptied = True
                self.fork(action.queue, now)
            elif isinstance(action, Stop):
                self.stop(self.slots[action.slot_no], "not in the row")
            elif isinstance(action, Switch):
                slot = self.slots[action.slot_no]
                if self.channels.send(slot.pid, SwitchQueue(queue=action.queue)):
                    slot.queue = action.queue

    def fork(self, queue: str, now: float) -> None:
        slot_no = next(n for n in range(len(self.slots) + 1) if n not in self.slots)
        try:
            if self.template is None:
                pid = self.effects.fork(queue, slot_no, self._slot_main)
            else:
                pid = self.effects.fork_via(self.template, queue, slot_no)
        except OSError as exc:  # at the descriptor or process limit: not the master's end
            logger.error("cannot fork a slot for %s (retried at the next pass): %s",
                         queue, exc)
            return
        if pid is None:
            return
        self.slots[slot_no] = SlotRecord(slot_no, pid, queue, self._wall_clock(), now, now,
                                         generation=self.generation)
        logger.info("slot %d (pid %d) started on %s%s", slot_no, pid, queue,
                    f" (generation {self.generation})" if self.generation else "")

    def stop(self, slot: SlotRecord, reason: str) -> None:
        """Graceful: the slot finishes and settles its batch, then exits."""
        if slot.stopping:
            return
        slot.move("stopping", reason)
        self.channels.send(slot.pid, StopSlot())
        self.effects.signal(slot.pid, signal.SIGTERM)

    def kill(self, slot: SlotRecord, reason: KillReason) -> None:
        logger.warning("slot %d (pid %d, %s): SIGKILL, %s", slot.slot_no, slot.pid,
                       slot.queue, reason)
        slot.kill_reason = reason
        self.effects.signal(slot.pid, signal.SIGKILL)

    def kill_all(self) -> None:
        for slot in self.slots.values():
            self.effects.signal(slot.pid, signal.SIGKILL)

    def receive(self, pid: int, now: float) -> None:
        slot = self.slot_of(pid)
        if slot is None:
            return
        for message in self.channels.receive(pid):
            on_message(slot, message, now)
            if isinstance(message, BatchDone):
                self.counters.add_batch(message.queue, message.counters)
                self.backoff.on_batch_done(slot.queue)
            elif isinstance(message, SlotHello):
                self.backoff.on_booted(slot.queue)
                self.give_backs.hand_over(self.slots.values())
                self.on_hello(slot)
            elif isinstance(message, GaveBack):
                self.give_backs.settled(pid, message.ref)

    def ended(self, pid: int, code: int, now: float, *, master_stopping: bool) -> None:
        """A child ended: forget its slot, count its restart, start its queue's backoff."""
        slot = self.slot_of(pid)
        if slot is None:
            self.on_other_child(pid, code)
            return
        self.receive(pid, now)  # its last packets (counters of its last batches)
        del self.slots[slot.slot_no]
        reason = decode_exit(slot, code, master_stopping=master_stopping)
        ran_a_job = self.give_backs.keep(reason, self.channels.last_take(pid), slot, code)
        self.give_backs.unsettled(pid)  # what it was handed and did not settle: to another
        self.channels.forget(pid)
        metrics.mark_slot_dead(slot.slot_no)
        logger.info("slot %d (pid %d, %s) exited with %d%s", slot.slot_no, pid, slot.queue,
                    code, f": restart ({reason})" if reason else "")
        self.on_ended(slot, reason, code)
        if reason is None:
            return
        self.counters.count_restart(slot.queue, reason)
        if ran_a_job:
            # A job killed it, and is charged for it: the queue's slots are not crash-looping
            # (its restart waits the base delay, as after a completed batch). A poison-only
            # queue otherwise waited up to 60 s a restart, no batch ever completing there.
            self.backoff.on_batch_done(slot.queue)
        fatal = self.backoff.on_restart(slot.queue, reason, now, slot.refused)
        if fatal:
            logger.error("queue %s is fatal on this host: %s", slot.queue, fatal)

    def reap(self, now: float, *, master_stopping: bool) -> int:
        """Bury every child that ended; returns how many."""
        ended = self.effects.reap()
        for pid, code in ended:
            self.ended(pid, code, now, master_stopping=master_stopping)
        if ended:
            self.give_backs.hand_over(self.slots.values())
        return len(ended)

    def bury_all(self, now: float) -> None:
        """SIGKILL every slot and wait for each (the master's last act)."""
        self.kill_all()
        while self.slots:
            ended = self.effects.reap(block=True)
            if not ended:
                break  # no child left to wait for
            for pid, code in ended:
                self.ended(pid, code, now, master_stopping=True)


class GiveBacks:
    """Dead slots' takes waiting for a live slot to settle them on the broker (the master
    has no broker connection)."""

    def __init__(self, channels: SlotChannels) -> None:
        self.channels = channels
        self.waiting: list[GiveBack] = []
        self.handed: dict[int, list[GiveBack]] = {}
        """Sent to a slot (by pid), kept until it answers GaveBack: if it dies first (a
        crash among crashes), the part goes to another slot instead of to lock expiry,
        which would charge every job in it. Settling a part twice changes nothing: each
        job moves only while the dead slot's lock still holds it."""
        self._refs = 0

    def keep(self, reason: RestartReason | None, last_take: GiveBack | None,
             slot: SlotRecord, code: int) -> bool:
        """A slot that died holding a take: keep what to settle for it, in parts that fit
        one packet each, saying which slot died and how. True when it died running a job
        (the job is charged for it)."""
        order = give_back(reason, last_take)
        if order is None or reason is None:
            return False
        died = {"slot": str(slot.slot_no), "died": death(slot, reason, code)}
        parts = []
        for part in _in_packets(order):
            self._refs += 1
            parts.append(part.model_copy(update={"ref": self._refs, **died}))
        self.waiting = [*self.waiting, *parts][-MAX_PENDING_GIVE_BACKS:]
        return any(job[3] == Progress.RUNNING for job in order.jobs)

    def settled(self, pid: int, ref: int) -> None:
        self.handed[pid] = [part for part in self.handed.get(pid, []) if part.ref != ref]

    def unsettled(self, pid: int) -> None:
        """The slot ``pid`` ended: what it was handed and did not settle waits again."""
        self.waiting = [*self.handed.pop(pid, []), *self.waiting][-MAX_PENDING_GIVE_BACKS:]

    def hand_over(self, slots: Iterable[SlotRecord]) -> None:
        """Send each waiting give-back to a live slot (idle first), which settles it on
        the broker between two batches; what no slot takes now waits for the next one."""
        if not self.waiting:
            return
        live = sorted((s for s in slots if not s.stopping),
                      key=lambda s: _GIVE_BACK_ORDER.get(s.state, 3))
        while self.waiting and live:
            if not self.channels.send(live[0].pid, self.waiting[0]):
                live.pop(0)  # its buffer is full: the next one
                continue
            logger.info("slot %d (pid %d) settles %d jobs a dead slot held on %s",
                        live[0].slot_no, live[0].pid, len(self.waiting[0].jobs),
                        self.waiting[0].queue)
            self.handed.setdefault(live[0].pid, []).append(self.waiting.pop(0))


#: What one GiveBack part may carry: its ids plus 48 bytes a job stay under this
#: (channel.MAX_PACKET_BYTES is 64 KiB; a bigger packet would not be sent).
GIVE_BACK_PART_BYTES = 48 * 1024


def _in_packets(order: GiveBack) -> list[GiveBack]:
    parts: list[GiveBack] = []
    jobs: list[tuple[str, int, float, int]] = []
    size = 0
    for job in order.jobs:
        cost = len(json.dumps(job[0])) + 48  # as JSON escapes it, at most
        if jobs and size + cost > GIVE_BACK_PART_BYTES:
            parts.append(order.model_copy(update={"jobs": jobs}))
            jobs, size = [], 0
        jobs.append(job)
        size += cost
    parts.append(order.model_copy(update={"jobs": jobs}))
    return parts
