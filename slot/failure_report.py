"""What a slot does when a handler raised: log it, count it, keep it with the job, tell
the hooks. Only failed batches come here: a batch whose jobs all succeeded pays nothing.

Each exception is logged once with its traceback, the queue, the job ids, the attempt and
what happens next ("retry at 20:31:05 (in 4.0 s)", "dead-lettered", "left locked"); past
a few of the same kind (type and raising line) in 10 s they are counted and summarised
("... and 312 more like it in 10 s", see slot.summary). The slot's stderr is its
master's, so these lines are in the master's log.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from qcluster.broker.base import Settlement
from qcluster.failures import JobError
from qcluster.hooks import Failure, HookRunner, HookSpec, Next
from qcluster.job import Job
from qcluster.policy import QueuePolicy
from qcluster.slot.summary import FailureSummariser, Summary

logger = logging.getLogger("qcluster.slot.failures")

#: Job ids named in one log line; the others are counted.
IDS_SHOWN = 5
#: Distinct exception labels per queue in qcluster_job_failures_total; past this the
#: others count as "other" (a label per message would flood Prometheus).
MAX_EXCEPTION_LABELS = 20
OTHER_EXCEPTION = "other"


def type_name(exc: BaseException) -> str:
    """``ValueError`` for builtins, else ``module.Qualname`` (``smtplib.SMTPException``)."""
    kind = type(exc)
    module = kind.__module__
    if module == "builtins":
        return kind.__qualname__
    return f"{module}.{kind.__qualname__}"


def format_traceback(exc: BaseException) -> str:
    """The traceback as Python prints it, without the column carets (``^^^^``): those
    cost a parse of each frame's line, 20 times the rest on Python 3.11, and a poison
    queue formats one per failure. Chained exceptions (``__cause__``) come first."""
    parts: list[str] = []
    seen: set[int] = set()
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(chain) < 5:
        seen.add(id(current))
        chain.append(current)
        current = current.__cause__ or (
            None if current.__suppress_context__ else current.__context__)
    for index, item in enumerate(reversed(chain)):
        if index:
            parts.append("\nThe above exception led to the following one:\n\n")
        if item.__traceback__ is not None:
            stack = traceback.StackSummary.extract(traceback.walk_tb(item.__traceback__),
                                                   lookup_lines=False)  # no stat() per file
            for frame in stack:
                frame.colno = None  # no carets
            parts += ["Traceback (most recent call last):\n", *stack.format()]
        parts += traceback.format_exception_only(item)
    return "".join(parts).rstrip()


def raise_site(exc: BaseException) -> tuple[str, int]:
    """The file and line that raised (the innermost frame), ("", 0) when never raised."""
    tb = exc.__traceback__
    if tb is None:
        return "", 0
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_filename, tb.tb_lineno


@dataclass(slots=True)
class _Group:
    """The jobs of one batch that one exception failed, with the same next step."""

    exception: BaseException
    next: Next
    jobs: list[Job]
    retry_at: float | None = None


class ExceptionLabels:
    """Bounded label values for the failure counter, per queue."""

    def __init__(self, limit: int = MAX_EXCEPTION_LABELS) -> None:
        self.limit = limit
        self._seen: dict[str, set[str]] = {}

    def label(self, queue: str, name: str) -> str:
        seen = self._seen.setdefault(queue, set())
        if name in seen:
            return name
        if len(seen) >= self.limit:
            return OTHER_EXCEPTION
        seen.add(name[:100])
        return name[:100]


class FailureReporter:
    """One slot's failure path: ``collect`` in the batch, ``report`` after it."""

    def __init__(self, slot: str, host: str, hooks: list[HookSpec],
                 count: Callable[[str, str, int], None] | None = None) -> None:
        self.slot, self.host = slot, host
        self.hooks = HookRunner(tuple(hooks))
        self.summariser = FailureSummariser()
        self.labels = ExceptionLabels()
        self._count = count
        self._tracebacks: dict[int, str] = {}

    def collect(self, queue: str, jobs: list[Job], settlement: Settlement,
                policy: QueuePolicy, now: float) -> list[Failure]:
        """The failures of a settled batch; fills ``settlement.errors`` for the jobs that
        come back or go to the dead letters because their handler raised."""
        delays = {id(d): delay for d, delay in settlement.postpone}
        dead = {id(d) for d, _ in settlement.dead}
        groups: dict[tuple[int, Next], _Group] = {}
        for job in jobs:
            exc = job.exception
            if job.outcome != "error" or exc is None:
                continue
            key = id(job.delivery)
            nxt: Next = "retry" if key in delays else "dead" if key in dead else "locked"
            group = groups.get((id(exc), nxt))
            if group is None:
                group = groups[id(exc), nxt] = _Group(exc, nxt, [])
            group.jobs.append(job)
            if nxt == "retry":
                at = now + delays[key]
                group.retry_at = at if group.retry_at is None else min(group.retry_at, at)
            if nxt != "locked":
                settlement.errors[job.id] = self._job_error(job, exc, now)
        return [self._failure(queue, group, policy) for group in groups.values()]

    def _traceback(self, exc: BaseException) -> str:
        text = self._tracebacks.get(id(exc))
        if text is None:
            text = self._tracebacks[id(exc)] = format_traceback(exc)
        return text

    def _job_error(self, job: Job, exc: BaseException, now: float) -> JobError:
        return JobError.bounded(type=type_name(exc), message=str(exc)[:1000],
                                traceback=self._traceback(exc), host=self.host,
                                slot=self.slot, attempt=job.attempts, at=now)

    def _failure(self, queue: str, group: _Group, policy: QueuePolicy) -> Failure:
        return Failure(queue=queue, jobs=tuple(group.jobs), exception=group.exception,
                       next=group.next, retry_at=group.retry_at,
                       attempt=max(job.attempts for job in group.jobs),
                       max_attempts=policy.max_attempts, host=self.host, slot=self.slot,
                       traceback=self._traceback(group.exception))

    def report(self, failures: list[Failure], budget_s: float,
               alive: Callable[[], None] | None = None) -> None:
        """Log and count ``failures`` (summarised past the limit), then call the hooks
        within ``budget_s`` seconds (``alive``: called now and then while waiting)."""
        now = time.monotonic()
        for failure in failures:
            exc = failure.exception
            name = type_name(exc)
            if self._count is not None:
                self._count(failure.queue, self.labels.label(failure.queue, name),
                            len(failure.jobs))
            if self.summariser.admit((failure.queue, name, *raise_site(exc)), now):
                logger.warning("%s\n%s", self.describe(failure), failure.traceback)
        self._tracebacks.clear()
        self.hooks.call(failures, budget_s, alive)
        self.tick(now)

    def tick(self, now: float) -> None:
        """Log the summaries whose window ended (called now and then by the slot)."""
        if now >= self.summariser.next_due:
            self._log_summaries(self.summariser.due(now))

    def flush(self) -> None:
        self._log_summaries(self.summariser.flush())

    def _log_summaries(self, summaries: list[Summary]) -> None:
        for summary in summaries:
            key: tuple[str, str, str, int] = summary.key  # type: ignore[assignment]
            queue, name, path, line = key
            where = f" at {path}:{line}" if path else ""
            logger.warning("slot %s (%s): ... and %d more like it in %.0f s (%s raised%s)",
                           self.slot, queue, summary.count, max(1.0, summary.seconds),
                           name, where)

    def describe(self, failure: Failure) -> str:
        """One line: which jobs, which attempt, what was raised, what happens next."""
        jobs = failure.jobs
        ids = ", ".join(job.id for job in jobs[:IDS_SHOWN])
        if len(jobs) > IDS_SHOWN:
            ids += f" and {len(jobs) - IDS_SHOWN} more"
        which = f"job {ids}" if len(jobs) == 1 else f"{len(jobs)} jobs ({ids})"
        exc = failure.exception
        return (f"slot {self.slot} ({failure.queue}): {which}, attempt {failure.attempt} of "
                f"{failure.max_attempts}, raised {type_name(exc)}: {exc}; "
                f"{next_step(failure)}")


def next_step(failure: Failure) -> str:
    if failure.next == "retry" and failure.retry_at is not None:
        at = time.strftime("%H:%M:%S", time.localtime(failure.retry_at))
        return f"retry at {at} (in {max(0.0, failure.retry_at - time.time()):.1f} s)"
    if failure.next == "dead":
        return f"dead-lettered: no attempt left (max_attempts {failure.max_attempts})"
    return "left locked until its lock expires (on_error lock)"
