"""How many slots this host can run now: a pure function of a probe's measurements.

The seed's formula: ``allowed = floor((sum_PSS(master + slots) + available - reserve) /
average_slot_PSS)`` with ``average_slot_PSS = sum_PSS / n_slots``. The master's own PSS is
deliberately not divided out: it is spread over the slots it serves. PSS, not RSS: pages
shared copy-on-write are counted once across the processes that share them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from qcluster.procfs import total_pss_bytes

MIB = 1 << 20


@dataclass(frozen=True)
class HostSample:
    """What the probe measured; no clock and no I/O here."""

    cpus: float
    """CPUs usable (cgroup cpu.max quota / period when set)."""
    load1: float
    mem_available_bytes: int
    master_pss_bytes: int
    slot_pss_bytes: tuple[int, ...] = field(default_factory=tuple)
    cgroup_memory_free_bytes: int | None = None
    """cgroup memory.max minus memory.current, when the cgroup has a limit."""

    @property
    def pss_total_bytes(self) -> int:
        """The master and its slots together."""
        return total_pss_bytes(self.master_pss_bytes, self.slot_pss_bytes)


@dataclass(frozen=True)
class CapacityLimits:
    reserve_bytes: int
    slot_pss_estimate_bytes: int
    max_load_per_cpu: float
    max_slots: int


def average_slot_pss(sample: HostSample, limits: CapacityLimits) -> int:
    """sum_PSS / n_slots, or the configured estimate before any slot exists."""
    if not sample.slot_pss_bytes:
        return limits.slot_pss_estimate_bytes
    total = sample.pss_total_bytes
    return max(1, total // len(sample.slot_pss_bytes))


def available_bytes(sample: HostSample) -> int:
    """MemAvailable, or less when a container's cgroup limit is closer."""
    if sample.cgroup_memory_free_bytes is None:
        return sample.mem_available_bytes
    return min(sample.mem_available_bytes, sample.cgroup_memory_free_bytes)


def capacity(sample: HostSample, limits: CapacityLimits) -> int:
    """Slots allowed on the host now (never negative, never above ``max_slots``)."""
    pss_total = sample.pss_total_bytes
    budget = pss_total + available_bytes(sample) - limits.reserve_bytes
    allowed = math.floor(budget / average_slot_pss(sample, limits))
    if sample.cpus > 0 and sample.load1 > limits.max_load_per_cpu * sample.cpus:
        # Overloaded CPUs: no more slots than the load cap, however much memory is free.
        allowed = min(allowed, math.floor(limits.max_load_per_cpu * sample.cpus))
    return max(0, min(allowed, limits.max_slots))
