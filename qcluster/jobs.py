"""Where a job is and since when: the answer of ``qcluster job ID``, ``Client.job(ID)``
and ``GET /api/v1/jobs/{id}`` (one model for the three), and a page of a queue's jobs in
one state (the admin page's job browser).

Each backend answers what it can know and says plainly what it cannot (``note``): a
Redis queue is searched by id; a RabbitMQ queue cannot be, so there a job that is only
waiting in its queue is ``unknown``, never a wrong state.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from qcluster.failures import JobError

if TYPE_CHECKING:
    from qcluster.broker.base import DeadJob

JobState = Literal["ready", "delayed", "running", "retrying", "dead", "finished", "unknown"]
#: The states a queue's jobs can be listed in (``GET /api/v1/queues/{q}/jobs?state=``).
LISTED_STATES: tuple[str, ...] = ("running", "delayed", "retrying", "dead")
#: The longest page of a listing.
MAX_PAGE = 500


class JobInfo(BaseModel):
    """One job: its state, since when, and what is known of it."""

    model_config = ConfigDict(frozen=True)

    id: str
    queue: str | None = None
    state: JobState
    since: float | None = None
    """Unix seconds: when it entered this state (enqueued, taken, dead, finished)."""
    next_run_at: float | None = None
    """Delayed or retrying: when it becomes ready."""
    attempts: int | None = None
    host: str | None = None
    slot: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    duration_s: float | None = None
    """Finished: from its last take to its ack."""
    reason: str | None = None
    """Dead: why it was dead-lettered."""
    last_error: JobError | None = None
    """The error of its last failed attempt, the record the broker stores (pydantic reads
    and writes the dataclass as JSON with the same fields)."""
    payload: Any = None
    """The job's payload (decoded JSON), not the stored envelope."""
    result: Any = None
    note: str | None = None
    """What cannot be known here (e.g. a RabbitMQ queue cannot be searched by id)."""
    lock_token: int | None = Field(default=None, exclude=True)
    """Running: the token of the take holding it (Redis: the lock's expiry, ms), which
    the masters report per slot; never shown (the manager turns it into host and slot)."""

    @classmethod
    def of_dead(cls, dead: DeadJob) -> JobInfo:
        """A dead letter as a job."""
        return cls(id=dead.id, queue=dead.queue, state="dead", since=dead.dead_at,
                   attempts=dead.attempts, reason=dead.reason,
                   last_error=dead.error, payload=payload_of(dead.body))


class JobPage(BaseModel):
    """A page of one queue's jobs in one state."""

    model_config = ConfigDict(frozen=True)

    queue: str
    state: str
    total: int | None
    """None: not counted (a filtered scan)."""
    offset: int
    limit: int
    jobs: list[JobInfo]
    note: str | None = None


def payload_of(body: bytes | str | None) -> Any:
    """The payload of a stored envelope, or None when it cannot be read (shown to
    operators: a damaged envelope is shown as nothing, never an error)."""
    if not body:
        return None
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return data.get("payload") if isinstance(data, dict) else None


def enqueued_at_of(body: bytes | str | None) -> float | None:
    """The producer's enqueue time of a stored envelope, when readable."""
    if not body:
        return None
    try:
        data = json.loads(body)
        value = data.get("enqueued_at") if isinstance(data, dict) else None
        return float(value) if isinstance(value, int | float) else None
    except (ValueError, UnicodeDecodeError, TypeError):
        return None
