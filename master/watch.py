"""The watch verdicts as pure functions: is a slot hung, is it far over its memory, and
when must the loop wake next.

No clock and no I/O: the supervisor passes ``now`` (monotonic seconds) and acts on the
verdict (SIGKILL, counted under the verdict's restart reason).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from qcluster.master.slots import KillReason, SlotRecord

MIB = 1 << 20


@dataclass(frozen=True)
class WatchLimits:
    heartbeat_timeout_s: float
    """A slot silent this long outside a batch is hung."""
    memory_kill_factor: float
    """A slot over this multiple of its queue's Private_Dirty limit is killed."""


def dirty_kill_bytes(private_dirty_limit_mb: float, limits: WatchLimits) -> float:
    return private_dirty_limit_mb * MIB * limits.memory_kill_factor


def is_hung(slot: SlotRecord, now: float, limits: WatchLimits) -> bool:
    """Past its batch deadline, or silent too long when not in a batch."""
    if slot.deadline is not None:
        return now >= slot.deadline
    return now - slot.last_seen > limits.heartbeat_timeout_s


def verdict(
    slot: SlotRecord, now: float, limits: WatchLimits, kill_bytes: float
) -> KillReason | None:
    """Why the slot must be killed now, or None (a slot already being killed: None)."""
    if slot.kill_reason is not None:
        return None
    if is_hung(slot, now, limits):
        return "hung"
    if slot.private_dirty_bytes > kill_bytes:
        return "memory"
    return None


def next_deadline(slots: Iterable[SlotRecord]) -> float | None:
    """The nearest batch deadline of a slot not already being killed: the loop must wake
    then, not at its next tick (a hung slot must die before its jobs' locks expire)."""
    return min((s.deadline for s in slots if s.deadline is not None and not s.kill_reason),
               default=None)


def wake_in(now: float, moments: Iterable[float | None], longest_s: float) -> float:
    """Seconds to sleep until the nearest of ``moments`` (None: no such moment), at most
    ``longest_s``, never negative."""
    nearest = min((m for m in moments if m is not None), default=now + longest_s)
    return max(0.0, min(longest_s, nearest - now))
