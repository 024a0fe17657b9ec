"""A slot's Prometheus metrics: counted in plain Python per batch, written to
prometheus_client's multiprocess files a few times a second."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from qcluster import metrics
from qcluster.job import Job
from qcluster.messages import BatchCounters

#: Seconds a slot counts in memory before writing its metrics (see SlotMetrics).
METRICS_WRITE_INTERVAL_S = 0.25


_OUTCOMES = ("done", "retried", "failed", "malformed")


class HistogramValues:
    """A histogram child's values without the child: its buckets' and its sum's, what
    :meth:`metrics.HistogramTally.write_to` adds to."""

    def __init__(self, name: str, labelnames: tuple[str, ...], labelvalues: tuple[str, ...],
                 bounds: Sequence[float]) -> None:
        from prometheus_client import values
        from prometheus_client.utils import floatToGoString

        documentation = metrics.SLOT_METRICS[name]
        self._sum = values.ValueClass("histogram", name, f"{name}_sum", labelnames,
                                      labelvalues, documentation)
        self._buckets = [
            values.ValueClass("histogram", name, f"{name}_bucket", (*labelnames, "le"),
                              (*labelvalues, floatToGoString(bound)), documentation)
            for bound in bounds]


class MostRecentGauge:
    """A ``livemostrecent`` gauge child's value without the child."""

    def __init__(self, name: str, labelnames: tuple[str, ...],
                 labelvalues: tuple[str, ...]) -> None:
        from prometheus_client import values

        self._value = values.ValueClass("gauge", name, name, labelnames, labelvalues,
                                        metrics.SLOT_METRICS[name],
                                        multiprocess_mode="livemostrecent")

    def set(self, value: float) -> None:
        self._value.set(float(value), timestamp=time.time())


def _counter(name: str, labelnames: tuple[str, ...], labelvalues: tuple[str, ...]) -> Any:
    """A counter child's value without the child (``inc`` adds to it)."""
    from prometheus_client import values

    metric = name.removesuffix("_total")
    return values.ValueClass("counter", metric, f"{metric}_total", labelnames, labelvalues,
                             metrics.SLOT_METRICS[name])


class QueueFigures:
    """One queue's figures since the last write, and the metric values they go to.

    The values are made as prometheus_client's children make theirs (the same value
    class, keys and files, so the same samples), without the children: made in each
    slot after the fork, the children's machinery cost it 0.1 MiB of private memory. The
    definitions (metrics.slot_metrics) stay what the names and help come from."""

    def __init__(self, queue: str, slot_label: str) -> None:
        self.done = 0
        self.outcomes = dict.fromkeys(_OUTCOMES, 0)
        self.outcome_children = {
            o: _counter(metrics.JOBS_TOTAL, ("queue", "outcome"), (queue, o))
            for o in _OUTCOMES}
        self.duration = metrics.HistogramTally(metrics.DURATION_BUCKETS)
        self.size = metrics.HistogramTally(metrics.BATCH_SIZE_BUCKETS)
        self.wait = metrics.HistogramTally(metrics.DURATION_BUCKETS, floor=0.0)
        self.duration_child = HistogramValues(metrics.BATCH_DURATION_SECONDS, ("queue",),
                                              (queue,), self.duration.bounds)
        self.size_child = HistogramValues(metrics.BATCH_SIZE, ("queue",), (queue,),
                                          self.size.bounds)
        self.wait_child = HistogramValues(metrics.JOB_WAIT_SECONDS, ("queue",), (queue,),
                                          self.wait.bounds)
        self.dirty_child = MostRecentGauge(metrics.SLOT_SELF_PRIVATE_DIRTY_BYTES,
                                           ("queue", "slot"), (queue, slot_label))

    def add(self, jobs: Sequence[Job], counters: BatchCounters) -> None:
        # Every line here runs once per batch: a no-op slot runs 1,000 batches a second.
        self.done += counters.done
        if counters.retried or counters.failed or counters.malformed:
            outcomes = self.outcomes
            outcomes["retried"] += counters.retried
            outcomes["failed"] += counters.failed
            outcomes["malformed"] += counters.malformed
        self.duration.add(counters.busy_s)
        self.size.add(len(jobs))
        first = jobs[0].delivery if jobs else None
        if first is not None:  # a batch is part of one take: its jobs share taken_at
            taken_at = first.taken_at
            self.wait.add_many([taken_at - job.activate_at for job in jobs])

    def write(self) -> None:
        self.outcomes["done"] += self.done
        self.done = 0
        for outcome, count in self.outcomes.items():
            if count:
                self.outcome_children[outcome].inc(count)
                self.outcomes[outcome] = 0
        self.duration.write_to(self.duration_child)
        self.size.write_to(self.size_child)
        self.wait.write_to(self.wait_child)


class SlotMetrics:
    """A slot's metrics, written to the multiprocess files every METRICS_WRITE_INTERVAL_S.

    Writing after every batch cost a no-op handler's slot 6% of its CPU (each write
    takes a lock and touches an mmap'ed file); counting in plain Python and writing a
    few times a second costs it about 3% (``make bench``). The price: a slot killed with
    SIGKILL loses at most the last interval's figures.
    """

    def __init__(self, slot_label: str) -> None:
        self.slot_label = slot_label
        self.defs = metrics.slot_metrics()
        self._queues: dict[str, QueueFigures] = {}
        self._next_write = time.monotonic() + METRICS_WRITE_INTERVAL_S

    def _for(self, queue: str) -> QueueFigures:
        figures = self._queues.get(queue)
        if figures is None:
            figures = self._queues[queue] = QueueFigures(queue, self.slot_label)
        return figures

    def observe(self, queue: str, jobs: Sequence[Job], counters: BatchCounters) -> None:
        self._for(queue).add(jobs, counters)
        if time.monotonic() >= self._next_write:
            self.write()

    def write(self) -> None:
        """Write what was counted since the last write (also when idle and when stopping)."""
        for figures in self._queues.values():
            figures.write()
        self._next_write = time.monotonic() + METRICS_WRITE_INTERVAL_S

    def count_failures(self, queue: str, exception: str, jobs: int) -> None:
        """``jobs`` failed by an ``exception`` (a bounded label, see failure_report)."""
        self.defs.failures.labels(queue, exception).inc(jobs)

    def private_dirty(self, queue: str, value: int) -> None:
        self._for(queue).dirty_child.set(value)
