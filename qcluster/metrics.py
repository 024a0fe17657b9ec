"""Metric names, labels and multiprocess plumbing, defined once.

Slots write into prometheus_client's multiprocess directory under a **stable slot
identifier** (``slot<N>``), not their PID, so metric files do not pile up with
restarts; the master serves them all. ``PROMETHEUS_MULTIPROC_DIR`` must be set
before ``prometheus_client`` is first imported (it picks its value class at import),
which is why this module imports it lazily and :func:`prepare_multiprocess_dir` is
called by the CLI before any role is imported.
"""

from __future__ import annotations

import math
import os
import shutil
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ENV_DIR = "PROMETHEUS_MULTIPROC_DIR"

#: Batch sizes seen by handlers (1 .. 10,000).
BATCH_SIZE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
#: Batch and wait durations, 1 ms .. 10 min.
DURATION_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 600,
)


def default_metrics_dir(host: str = "local") -> Path:
    """Per-host directory on tmpfs (/dev/shm) when it is writable, else under /tmp."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path("/tmp")
    return base / f"qcluster-metrics-{os.getuid()}-{host}"


def prepare_multiprocess_dir(path: Path, *, wipe: bool) -> Path:
    """Create (and with ``wipe``, empty) the directory and export it for prometheus_client."""
    if wipe and path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    os.environ[ENV_DIR] = str(path)
    return path


def multiprocess_enabled() -> bool:
    return bool(os.environ.get(ENV_DIR))


def use_slot_identity(slot_no: int) -> None:
    """In a freshly forked slot: write metric files as ``slot<N>`` instead of the PID."""
    if not multiprocess_enabled():
        return
    from prometheus_client import values

    identity = f"slot{slot_no}"
    values.ValueClass = values.MultiProcessValue(process_identifier=lambda: identity)


def mark_slot_dead(slot_no: int) -> None:
    """After reaping a slot: drop its live gauges before the number is reused."""
    if not multiprocess_enabled():
        return
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(f"slot{slot_no}")


@cache
def slot_metrics() -> Any:
    """The metrics a slot (or a producer) writes. Created on first use, in the slot.

    All are labelled: an unlabelled metric would create its value (and its file) in
    the master at import, under the master's identity.
    """
    from prometheus_client import Counter, Gauge, Histogram

    return SimpleNamespace(
        jobs=Counter("qcluster_jobs_total", "Jobs settled, by outcome.", ["queue", "outcome"]),
        failures=Counter(
            "qcluster_job_failures_total", "Handler exceptions, by type.", ["queue", "exception"]
        ),
        batch_duration=Histogram(
            "qcluster_batch_duration_seconds", "Handler time per batch.", ["queue"],
            buckets=DURATION_BUCKETS,
        ),
        batch_size=Histogram(
            "qcluster_batch_size", "Jobs per batch.", ["queue"], buckets=BATCH_SIZE_BUCKETS
        ),
        job_wait=Histogram(
            "qcluster_job_wait_seconds", "From activation time to take (broker clock).",
            ["queue"], buckets=DURATION_BUCKETS,
        ),
        published=Counter("qcluster_published_jobs_total", "Jobs published.", ["queue"]),
        slot_busy=Gauge(
            "qcluster_slot_busy", "1 while the slot runs a batch.", ["queue", "slot"],
            multiprocess_mode="livemostrecent",
        ),
        slot_private_dirty=Gauge(
            "qcluster_slot_self_private_dirty_bytes", "Private_Dirty the slot last read of itself.",
            ["queue", "slot"], multiprocess_mode="livemostrecent",
        ),
    )


def observe_many(histogram: Any, values: Sequence[float]) -> None:
    """Record ``values`` in a histogram child with one write per bucket touched.

    In multiprocess mode every ``observe`` writes the mmap'ed file twice under a lock;
    a batch of 100 jobs' waits would cost 200 writes. prometheus_client has no bulk
    observe, so this uses the child's bucket values when they are there (checked by
    tests against ``observe``) and falls back to ``observe`` otherwise.
    """
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for value in values:
            histogram.observe(value)
        return
    if not values:
        return
    ordered = sorted(values)  # a batch comes oldest first: nearly sorted, so this is cheap
    if ordered[0] < 0:  # a clock step between two hosts: a wait is never negative
        ordered = [max(0.0, v) for v in ordered]
    # bisect_left finds the first bound >= value: observe's `value <= bound` rule.
    index, start = bisect_left(bounds, ordered[0]), 0
    while start < len(ordered) and index < len(bounds):  # (NaN fits no bucket, as in observe)
        end = bisect_right(ordered, bounds[index], start)  # values up to this bound
        if end > start:
            buckets[index].inc(end - start)
        start, index = end, index + 1
    total.inc(math.fsum(ordered))


#: Names the master and the manager export from their own registries (documented here so
#: dashboards and alert rules have one list to check against).
MASTER_METRICS = (
    "qcluster_host_capacity_slots",
    "qcluster_host_mem_available_bytes",
    "qcluster_host_pss_total_bytes",
    "qcluster_slots",  # {queue, state}
    "qcluster_slot_pss_bytes",  # {slot, queue}
    "qcluster_slot_private_dirty_bytes",  # {slot, queue}
    "qcluster_slot_last_seen_timestamp_seconds",  # {slot, queue}
    "qcluster_slot_restarts_total",  # {queue, reason}
)
MANAGER_METRICS = (
    "qcluster_queue_backlog",  # {queue}
    "qcluster_queue_locked",
    "qcluster_queue_delayed",
    "qcluster_queue_dead",
    "qcluster_queue_load_ratio",
    "qcluster_queue_slots_planned",
    "qcluster_queue_slots_current",
    "qcluster_hosts_alive",
    "qcluster_host_up",  # {host}
    "qcluster_planning_round_seconds",
)
