"""Measurements for the capacity function: memory (PSS, MemAvailable), load, cgroup limits.

PSS and Private_Dirty come from /proc/PID/smaps_rollup (one summed file per process,
tens of microseconds; bench/master_bench.py measures reading 100 slots).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import psutil

from qcluster.master.capacity import HostSample
from qcluster.procfs import MemorySample, read_memory

CGROUP_ROOT = Path("/sys/fs/cgroup")
#: cgroup v1 reports "no limit" as a huge page-aligned number.
V1_UNLIMITED = 1 << 60


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cgroup_cpus(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs allowed by cpu.max (v2) or cfs quota (v1); None when unlimited."""
    v2 = _read(root / "cpu.max")
    if v2:
        quota, _, period = v2.partition(" ")
        if quota != "max" and period:
            return int(quota) / int(period)
        return None
    quota_v1 = _read(root / "cpu" / "cpu.cfs_quota_us")
    period_v1 = _read(root / "cpu" / "cpu.cfs_period_us")
    if quota_v1 and period_v1 and int(quota_v1) > 0:
        return int(quota_v1) / int(period_v1)
    return None


def cgroup_memory_free(root: Path = CGROUP_ROOT) -> int | None:
    """memory.max - memory.current (v2) or the v1 equivalents; None without a limit."""
    limit = _read(root / "memory.max")
    usage = _read(root / "memory.current")
    if limit is None:
        limit = _read(root / "memory" / "memory.limit_in_bytes")
        usage = _read(root / "memory" / "memory.usage_in_bytes")
    if not limit or not usage or limit == "max" or int(limit) >= V1_UNLIMITED:
        return None
    return max(0, int(limit) - int(usage))


def usable_cpus() -> float:
    cpus = float(len(os.sched_getaffinity(0)))
    quota = cgroup_cpus()
    return min(cpus, quota) if quota else cpus


def sample_host(slot_memory: Iterable[MemorySample]) -> HostSample:
    """The host now, given the slots' latest memory samples."""
    master = read_memory("self")
    return HostSample(
        cpus=usable_cpus(),
        load1=os.getloadavg()[0],
        mem_available_bytes=int(psutil.virtual_memory().available),
        master_pss_bytes=master.pss_bytes if master else 0,
        slot_pss_bytes=tuple(sample.pss_bytes for sample in slot_memory),
        cgroup_memory_free_bytes=cgroup_memory_free(),
    )


def read_slot_memory(pids: Iterable[int]) -> dict[int, MemorySample]:
    """smaps_rollup of each live pid (a pid that just exited is left out)."""
    samples = {}
    for pid in pids:
        sample = read_memory(pid)
        if sample is not None:
            samples[pid] = sample
    return samples
