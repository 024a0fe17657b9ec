"""Queue policy: everything the cluster needs to know about serving one queue.

The field names are the public API: the same keywords work in ``@app.queue(...)``
and as keys of ``[queues.NAME]`` in ``qcluster.toml``. Durations are float seconds,
memory is MiB, counts are whole numbers.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from qcluster.names import QUEUE_NAME_PATTERN as QUEUE_NAME_PATTERN  # the one rule: names.py

#: Bounds that keep every figure the planner and the brokers compute with sane.
MAX_SLOTS = 100_000
MAX_DURATION_S = 7 * 86_400.0
DEFAULT_LOCK_TIMEOUT = 60.0
DEFAULT_BATCH_TIMEOUT = 30.0
#: A queue's warm slot outlives its last job by this much (KEDA's cooldownPeriod default).
DEFAULT_IDLE_S = 300.0
#: The master kills a hung slot at its batch deadline; the kill takes time (the master's
#: loop, the signal, a busy machine). A job's lock must outlast the deadline by this much,
#: or a second slot could take the job while the first still runs it.
MIN_KILL_MARGIN_S = 1.0
KILL_MARGIN_FRACTION = 0.1
#: Dead-letter retention: the defaults (what every queue had before they were per queue)
#: and the largest values accepted.
DEFAULT_DEAD_MAX_COUNT = 10_000
DEFAULT_DEAD_MAX_AGE = 14 * 86_400.0
MAX_DEAD_COUNT = 1_000_000
MAX_DEAD_AGE_S = 365 * 86_400.0
MIN_DEAD_AGE_S = 1.0
#: Finished-job records (job lookup): kept this long by default, at most this long, and at
#: most about this many per queue.
DEFAULT_KEEP_FINISHED_S = 300.0
MAX_KEEP_FINISHED_S = 7 * 86_400.0
FINISHED_MAX_COUNT = 100_000
#: The most jobs an async per-job handler awaits at once (as many as the largest batch).
MAX_CONCURRENCY = 2_000
#: A derived pair sits exactly on the rule: let float rounding not refuse it.
FLOAT_SLACK = 1e-9


def kill_margin(batch_timeout: float) -> float:
    """Seconds the lock must outlast a batch deadline: max(1 s, 10% of batch_timeout)."""
    return max(MIN_KILL_MARGIN_S, KILL_MARGIN_FRACTION * batch_timeout)


def batch_timeout_for(lock_timeout: float) -> float:
    """The longest batch_timeout whose deadline plus kill margin fits in ``lock_timeout``,
    capped at the default; 0 when the lock is too short for any."""
    longest = min(lock_timeout - MIN_KILL_MARGIN_S, lock_timeout / (1 + KILL_MARGIN_FRACTION))
    return max(0.0, min(DEFAULT_BATCH_TIMEOUT, longest))


def lock_timeout_for(batch_timeout: float) -> float:
    """The default lock_timeout, or longer when ``batch_timeout`` plus its margin needs it."""
    return max(DEFAULT_LOCK_TIMEOUT, batch_timeout + kill_margin(batch_timeout))


class QueuePolicy(BaseModel):
    """How one queue is served. Validated once, immutable afterwards."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    batch_size: int = Field(1, ge=1, le=2_000)
    """Jobs taken per round trip and handed to the handler at once."""
    priority: int = Field(0, ge=-100, le=100)
    """Higher goes first when the cluster is short of slots."""
    min_slots: int = Field(0, ge=0, le=MAX_SLOTS)
    """Slots kept even when the queue is idle (so its first job starts at once)."""
    max_slots: int = Field(100, ge=0, le=MAX_SLOTS)
    """Never more slots than this for the queue, however long its backlog."""
    lock_timeout: float = Field(DEFAULT_LOCK_TIMEOUT, gt=0, le=MAX_DURATION_S)
    """Seconds a taken job stays invisible to other slots before it comes back. Must be at
    least batch_timeout + max(1 s, 10% of batch_timeout). Set alone, batch_timeout is
    derived from it (the longest that fits, at most 30 s)."""
    batch_timeout: float = Field(DEFAULT_BATCH_TIMEOUT, gt=0, le=MAX_DURATION_S)
    """Seconds a batch may run; past it the master kills the slot (hung). Set alone,
    lock_timeout is derived from it (60 s, or longer when the margin needs it)."""
    max_attempts: int = Field(5, ge=1, le=1_000_000)
    """Takes before a failing job goes to the dead-letter store."""
    on_error: Literal["retry", "lock"] = "retry"
    """A raising handler: retry with backoff (default) or leave the jobs locked."""
    retry_base_delay: float = Field(1.0, gt=0, le=MAX_DURATION_S)
    """First retry delay in seconds; doubles per attempt, with jitter."""
    retry_max_delay: float = Field(300.0, gt=0, le=MAX_DURATION_S)
    """Cap on the retry delay in seconds."""
    private_dirty_limit_mb: float = Field(512.0, gt=0, le=1 << 30)
    """A slot whose Private_Dirty passes this recycles itself after its batch."""
    target_wait: float | None = Field(None, gt=0, le=MAX_DURATION_S)
    """Optional: seconds within which a backlog should drain (raises planned slots)."""
    size_by: Literal["utilization", "wait"] = "utilization"
    """How the manager sizes the queue: "utilization" (default) plans its slots at the
    manager's target_utilization; "wait" plans them as busy as its target_wait allows (up
    to 95%: the fewest slots whose predicted p99 wait stays within half the target_wait,
    never more than target_utilization gives). Needs a target_wait. Fewer idle slots, less
    room for a rising rate (docs/manager.md, "Planning")."""
    idle_s: float = Field(DEFAULT_IDLE_S, ge=0, le=MAX_DURATION_S)
    """Seconds a queue that had work keeps one warm slot after its last job before it goes
    to zero (its next job then waits for no fork); 0: released as soon as it is idle.
    ``min_slots`` stays the floor."""
    est_job_seconds: float = Field(0.05, gt=0, le=MAX_DURATION_S)
    """Assumed job time before any job of the queue has been measured."""
    max_message_bytes: int = Field(1 << 20, ge=64, le=1 << 30)
    """Bigger messages are refused on publish and dead-lettered on take."""
    queue_type: Literal["classic", "quorum"] | None = None
    """RabbitMQ only: "quorum" (replicated, survives a node loss) or "classic" (faster on
    one node). Default (None): the broker URL's ``?queue_type=``, else classic. Ignored by
    Redis."""
    dead_max_count: int = Field(DEFAULT_DEAD_MAX_COUNT, ge=1, le=MAX_DEAD_COUNT)
    """Dead letters kept for the queue (1 to 1,000,000); past it the oldest are deleted
    when another job of the queue is dead-lettered."""
    dead_max_age: float = Field(DEFAULT_DEAD_MAX_AGE, ge=MIN_DEAD_AGE_S, le=MAX_DEAD_AGE_S)
    """Seconds a dead letter is kept (1 s to 365 days; default 14 days)."""
    keep_finished_s: float = Field(DEFAULT_KEEP_FINISHED_S, ge=0, le=MAX_KEEP_FINISHED_S)
    """Seconds a finished job's record (when it finished, how long it ran) is kept for
    ``qcluster job ID`` (0: none; default 5 minutes; at most about 100,000 per queue)."""
    concurrency: int | None = Field(None, ge=1, le=MAX_CONCURRENCY)
    """Async per-job handlers (``app.job_queue`` with ``async def``) only: at most this many
    of a batch's jobs are awaited at once (1 to 2,000). Default (None): the whole batch,
    that is ``batch_size``. Refused on any other handler (see qcluster.app)."""

    @model_validator(mode="before")
    @classmethod
    def _derive_timeouts(cls, data: Any) -> Any:
        """Only one of lock_timeout / batch_timeout given: derive the other from it."""
        if not isinstance(data, dict):
            return data
        has_lock, has_batch = "lock_timeout" in data, "batch_timeout" in data
        value = _finite(data.get("lock_timeout" if has_lock else "batch_timeout"))
        if has_lock == has_batch or value is None:
            return data
        if has_lock:
            batch = batch_timeout_for(value)
            if batch <= 0:
                raise ValueError(
                    f"lock_timeout ({value:g}s) leaves no time for a batch: it must "
                    f"be longer than {MIN_KILL_MARGIN_S:g}s, the margin the master needs "
                    "to kill a hung slot before its jobs' locks expire")
            return {**data, "batch_timeout": batch}
        return {**data, "lock_timeout": lock_timeout_for(value)}

    @model_validator(mode="after")
    def _check_consistency(self) -> QueuePolicy:
        margin = kill_margin(self.batch_timeout)
        if self.lock_timeout < self.batch_timeout + margin - FLOAT_SLACK:
            raise ValueError(
                f"lock_timeout ({self.lock_timeout:g}s) must be at least batch_timeout "
                f"({self.batch_timeout:g}s) + {margin:g}s: the master kills a slot at its "
                "batch deadline, the kill takes up to max(1s, 10% of batch_timeout), and a "
                "lock that expires first would hand the same jobs to a second slot while the "
                "first still runs them. Raise lock_timeout or lower batch_timeout (or set "
                "only one of them: the other is derived)."
            )
        if self.size_by == "wait" and self.target_wait is None:
            raise ValueError(
                'size_by = "wait" needs a target_wait: the queue is sized by its predicted '
                'wait against it (set target_wait, or size_by = "utilization")')
        if self.min_slots > self.max_slots:
            raise ValueError(
                f"min_slots ({self.min_slots}) is above max_slots ({self.max_slots})"
            )
        return self

    @property
    def kill_margin(self) -> float:
        """Seconds this queue's locks outlast a batch deadline at the least."""
        return kill_margin(self.batch_timeout)

    def merged(self, overrides: dict[str, object]) -> QueuePolicy:
        """This policy with ``overrides`` applied (validated again). Overriding only one of
        lock_timeout / batch_timeout derives the other when the pair would not fit."""
        base = self.model_dump()
        timeouts = {"lock_timeout", "batch_timeout"}
        if len(timeouts & set(overrides)) == 1:
            candidate = {**base, **overrides}
            if not _timeouts_fit(candidate):
                base.pop((timeouts - set(overrides)).pop())
        return QueuePolicy.model_validate({**base, **overrides})


def _finite(value: object) -> float | None:
    """``value`` as a float when it is a finite number; None otherwise."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _timeouts_fit(values: dict[str, Any]) -> bool:
    lock, batch = _finite(values.get("lock_timeout")), _finite(values.get("batch_timeout"))
    if lock is None or batch is None:
        return True  # let validation name what is wrong
    return lock >= batch + kill_margin(batch) - FLOAT_SLACK
