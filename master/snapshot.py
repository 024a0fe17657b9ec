"""What the HTTP and reporter threads may read of the supervisor: a snapshot replaced as a
whole after every pass of the loop, built here by a pure function."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from qcluster.master.capacity import CapacityLimits, HostSample, average_slot_pss
from qcluster.master.slots import SlotRecord
from qcluster.messages import CodeInfo, SlotInfo


@dataclass(frozen=True)
class SupervisorSnapshot:
    slots: list[SlotInfo] = field(default_factory=list)
    last_seen: dict[int, float] = field(default_factory=dict)
    """Slot number -> wall-clock unix seconds of its last message."""
    started_mono: dict[int, float] = field(default_factory=dict)
    """Slot number -> monotonic seconds it was forked at (for alive_s)."""
    sample: HostSample | None = None
    capacity_slots: int = 0
    avg_slot_pss_bytes: int = 0
    restarts: dict[tuple[str, str], int] = field(default_factory=dict)
    desired: dict[str, int] = field(default_factory=dict)
    fatal: dict[str, str] = field(default_factory=dict)
    """Queues no longer forked (repeated boot errors) -> why."""
    code: CodeInfo = field(default_factory=CodeInfo)
    """The code the slots run and the state of its reload (master/reload.py)."""
    reloads: dict[str, int] = field(default_factory=dict)
    """Reloads by result (took, failed) since the master started."""


@dataclass(frozen=True)
class HostReading:
    """The host side of a snapshot: the last probe and what it allows."""

    sample: HostSample | None
    capacity_slots: int
    limits: CapacityLimits


def build_snapshot(
    slots: Iterable[SlotRecord], host: HostReading, *, restarts: dict[tuple[str, str], int],
    desired: dict[str, int], fatal: dict[str, str], wall_now: float, mono_now: float,
    code: CodeInfo | None = None, reloads: dict[str, int] | None = None,
    takes: dict[int, int] | None = None,
) -> SupervisorSnapshot:
    """``takes``: each slot's held lock token by pid (SlotInfo.take)."""
    ordered = sorted(slots, key=lambda s: s.slot_no)
    sample = host.sample
    return SupervisorSnapshot(
        slots=[s.info((takes or {}).get(s.pid)) for s in ordered],
        last_seen={s.slot_no: wall_now - (mono_now - s.last_seen) for s in ordered},
        started_mono={s.slot_no: s.started_mono for s in ordered},
        sample=sample,
        capacity_slots=host.capacity_slots,
        avg_slot_pss_bytes=average_slot_pss(sample, host.limits) if sample else 0,
        restarts=restarts,
        desired=dict(desired),
        fatal=dict(fatal),
        code=code or CodeInfo(),
        reloads=dict(reloads or {}),
    )
