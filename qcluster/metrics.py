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


_slot_identity = ""
"""``slot<N>`` in a slot (set by :func:`use_slot_identity`); empty in any other process."""


def _process_identifier() -> str:
    return _slot_identity or str(os.getpid())


@cache
def slot_value_class() -> Any:
    """The value class of a slot's metrics, named by :func:`_process_identifier`.

    Made once, in the master before it forks (qcluster.slot.prefork): a class made in
    each slot would cost it some 170 KiB of private memory (the new type, and the shared
    pages it touches). Nothing in the master uses it; a slot detects its new identity at
    its first value and opens its own files then.
    """
    from prometheus_client import values

    return values.MultiProcessValue(process_identifier=_process_identifier)


def use_slot_identity(slot_no: int) -> None:
    """In a freshly forked slot: write metric files as ``slot<N>`` instead of the PID."""
    global _slot_identity
    if not multiprocess_enabled():
        return
    from prometheus_client import values

    _slot_identity = f"slot{slot_no}"
    values.ValueClass = slot_value_class()


def mark_slot_dead(slot_no: int) -> None:
    """After reaping a slot: drop its live gauges before the number is reused."""
    if not multiprocess_enabled():
        return
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(f"slot{slot_no}")


#: What the slots write (:func:`slot_metrics`), name -> help.
JOBS_TOTAL = "qcluster_jobs_total"
JOB_FAILURES_TOTAL = "qcluster_job_failures_total"
BATCH_DURATION_SECONDS = "qcluster_batch_duration_seconds"
BATCH_SIZE = "qcluster_batch_size"
JOB_WAIT_SECONDS = "qcluster_job_wait_seconds"
PUBLISHED_JOBS_TOTAL = "qcluster_published_jobs_total"
SLOT_BUSY = "qcluster_slot_busy"
SLOT_SELF_PRIVATE_DIRTY_BYTES = "qcluster_slot_self_private_dirty_bytes"
SLOT_METRICS: dict[str, str] = {
    JOBS_TOTAL: "Jobs settled, by outcome.",
    JOB_FAILURES_TOTAL: "Handler exceptions, by type.",
    BATCH_DURATION_SECONDS: "Handler time per batch.",
    BATCH_SIZE: "Jobs per batch.",
    JOB_WAIT_SECONDS: "From activation time to take (broker clock).",
    PUBLISHED_JOBS_TOTAL: "Jobs published.",
    SLOT_BUSY: "1 while the slot runs a batch.",
    SLOT_SELF_PRIVATE_DIRTY_BYTES: "Private_Dirty the slot last read of itself.",
}


@cache
def slot_metrics() -> Any:
    """The metrics a slot (or a producer) writes. Made by the master before it forks
    (qcluster.slot.prefork), so that its slots share the definitions.

    All are labelled: an unlabelled metric would create its value (and its file) in
    the master, under the master's identity.
    """
    from prometheus_client import Counter, Gauge, Histogram

    def named(name: str) -> tuple[str, str]:
        return name, SLOT_METRICS[name]

    return SimpleNamespace(
        jobs=Counter(*named(JOBS_TOTAL), ["queue", "outcome"]),
        failures=Counter(*named(JOB_FAILURES_TOTAL), ["queue", "exception"]),
        batch_duration=Histogram(
            *named(BATCH_DURATION_SECONDS), ["queue"], buckets=DURATION_BUCKETS,
        ),
        batch_size=Histogram(*named(BATCH_SIZE), ["queue"], buckets=BATCH_SIZE_BUCKETS),
        job_wait=Histogram(*named(JOB_WAIT_SECONDS), ["queue"], buckets=DURATION_BUCKETS),
        published=Counter(*named(PUBLISHED_JOBS_TOTAL), ["queue"]),
        slot_busy=Gauge(
            *named(SLOT_BUSY), ["queue", "slot"], multiprocess_mode="livemostrecent",
        ),
        slot_private_dirty=Gauge(
            *named(SLOT_SELF_PRIVATE_DIRTY_BYTES), ["queue", "slot"],
            multiprocess_mode="livemostrecent",
        ),
    )


class HistogramTally:
    """A histogram's bucket counts and sum, kept in plain Python between writes.

    In multiprocess mode every ``observe`` writes an mmap'ed file twice under a lock:
    a slot running 100,000 no-op jobs a second would spend more time recording than
    working. A slot adds its figures here (list increments) and writes them with
    :meth:`write_to` a few times a second, one write per bucket touched. The figures
    collected are exactly those of one ``observe`` per value (the tests check).
    """

    def __init__(self, buckets: Sequence[float], *, floor: float = -math.inf) -> None:
        """``floor``: values below it count as it (a wait is never negative, whatever a
        clock step between two hosts says)."""
        bounds = [float(b) for b in buckets]
        if bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.bounds = tuple(bounds)
        self.counts = [0] * len(bounds)
        self.total = 0.0
        self.pending = False
        self.floor = floor

    def add(self, value: float) -> None:
        if value < self.floor:
            value = self.floor
        if value == value:  # NaN counts in the sum only, as with observe
            # bisect_left finds the first bound >= value: observe's `value <= bound` rule.
            self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value
        self.pending = True

    def add_many(self, values: Sequence[float]) -> None:
        """Add a batch's values: sorted once, then one bisect per bucket touched."""
        if not values:
            return
        ordered = sorted(values)  # a batch comes oldest first: one run, so this is cheap
        if ordered[0] < self.floor:
            ordered = [max(self.floor, v) for v in ordered]
        bounds, counts = self.bounds, self.counts
        index, start, size = bisect_left(bounds, ordered[0]), 0, len(ordered)
        while start < size and index < len(bounds):  # (NaN fits no bucket, as in observe)
            end = bisect_right(ordered, bounds[index], start)
            counts[index] += end - start
            start, index = end, index + 1
        self.total += sum(ordered)
        self.pending = True

    def write_to(self, histogram: Any) -> None:
        """Add the figures to a prometheus_client histogram child, then start from zero."""
        if not self.pending:
            return
        buckets = getattr(histogram, "_buckets", None)
        total = getattr(histogram, "_sum", None)
        if buckets is None or total is None or len(buckets) != len(self.bounds):
            raise TypeError(f"{histogram!r} is not a histogram child with these buckets")
        for index, count in enumerate(self.counts):
            if count:
                buckets[index].inc(count)
                self.counts[index] = 0
        total.inc(self.total)
        self.total = 0.0
        self.pending = False


# The master's and the manager's own metrics: one definition of each name and its help,
# which master/http.py and manager/api/metrics.py export and deploy/ (dashboard, alert rules)
# is checked against (tests/deploy).

#: The master's gauges and counter, name -> help (labels in the comment).
MASTER_METRICS_HELP: dict[str, str] = {
    "qcluster_host_capacity_slots": "Slots this host can run now.",
    "qcluster_host_mem_available_bytes": "MemAvailable (or the cgroup's free memory).",
    "qcluster_host_pss_total_bytes": "PSS of the master and its slots.",
    "qcluster_slots": "Slots by queue and state.",  # {queue, state}
    "qcluster_slot_pss_bytes": "PSS of each slot.",  # {slot, queue}
    "qcluster_slot_private_dirty_bytes": "Private_Dirty of each slot.",  # {slot, queue}
    "qcluster_slot_last_seen_timestamp_seconds":
        "Last message from each slot (unix time).",  # {slot, queue}
    "qcluster_slot_restarts_total": "Slot restarts by queue and reason.",  # {queue, reason}
    "qcluster_master_code_info":
        "1 for the code new slots run: its version, generation and reload state.",
        # {version, generation, state}
    "qcluster_master_old_slots": "Slots still running older code during a reload.",
    "qcluster_master_reloads_total": "Code reloads by result (took, failed).",  # {result}
}
MASTER_METRICS = tuple(MASTER_METRICS_HELP)

#: The manager's per-queue gauges {queue}: name -> (help, field of the queue's view row).
MANAGER_QUEUE_GAUGES: dict[str, tuple[str, str]] = {
    "qcluster_queue_backlog": ("Ready jobs.", "backlog"),
    "qcluster_queue_locked": ("Jobs taken and not settled.", "locked"),
    "qcluster_queue_delayed": ("Jobs waiting for their activation time.", "delayed"),
    "qcluster_queue_dead": ("Dead-lettered jobs.", "dead"),
    "qcluster_queue_load_ratio": ("Load over the window (1 = 100%).", "load"),
    "qcluster_queue_slots_planned": ("Slots the manager plans.", "slots_planned"),
    "qcluster_queue_slots_current": ("Slots running now.", "slots_current"),
}
#: The manager's other gauges, name -> help.
MANAGER_GAUGES: dict[str, str] = {
    "qcluster_host_up": "1 while the host reports.",  # {host}
    "qcluster_hosts_alive": "Hosts reporting.",
    "qcluster_planning_round_seconds": "Last planning round.",
    # {host, reason}: another_broker, two_masters
    "qcluster_reports_refused": "1 while a master's reports under this host name are refused.",
}
MANAGER_METRICS = (*MANAGER_QUEUE_GAUGES, *MANAGER_GAUGES)
