"""Queue policy: everything the cluster needs to know about serving one queue.

The field names are the public API: the same keywords work in ``@app.queue(...)``
and as keys of ``[queues.NAME]`` in ``qcluster.toml``. Durations are float seconds,
memory is MiB.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

QUEUE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"


class QueuePolicy(BaseModel):
    """How one queue is served. Validated once, immutable afterwards."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    batch_size: int = Field(1, ge=1, le=2_000)
    """Jobs taken per round trip and handed to the handler at once."""
    priority: int = Field(0, ge=-100, le=100)
    """Higher goes first when the cluster is short of slots."""
    min_slots: int = Field(0, ge=0)
    """Slots kept even when the queue is idle (so its first job starts at once)."""
    max_slots: int = Field(100, ge=0)
    """Never more slots than this for the queue, however long its backlog."""
    lock_timeout: float = Field(60.0, gt=0)
    """Seconds a taken job stays invisible to other slots before it comes back."""
    batch_timeout: float = Field(30.0, gt=0)
    """Seconds a batch may run; past it the master kills the slot (hung)."""
    max_attempts: int = Field(5, ge=1)
    """Takes before a failing job goes to the dead-letter store."""
    on_error: Literal["retry", "lock"] = "retry"
    """A raising handler: retry with backoff (default) or leave the jobs locked."""
    retry_base_delay: float = Field(1.0, gt=0)
    """First retry delay in seconds; doubles per attempt, with jitter."""
    retry_max_delay: float = Field(300.0, gt=0)
    """Cap on the retry delay in seconds."""
    private_dirty_limit_mb: float = Field(512.0, gt=0)
    """A slot whose Private_Dirty passes this recycles itself after its batch."""
    target_wait: float | None = Field(None, gt=0)
    """Optional: seconds within which a backlog should drain (raises planned slots)."""
    est_job_seconds: float = Field(0.05, gt=0)
    """Assumed job time before any job of the queue has been measured."""
    max_message_bytes: int = Field(1 << 20, ge=64)
    """Bigger messages are refused on publish and dead-lettered on take."""

    @model_validator(mode="after")
    def _check_consistency(self) -> QueuePolicy:
        if self.lock_timeout <= self.batch_timeout:
            raise ValueError(
                f"lock_timeout ({self.lock_timeout:g}s) must be longer than batch_timeout "
                f"({self.batch_timeout:g}s): the master kills a slot at its batch deadline, "
                "and a lock that expires first would hand the same jobs to a second slot "
                "while the first still runs them. Raise lock_timeout or lower batch_timeout."
            )
        if self.min_slots > self.max_slots:
            raise ValueError(
                f"min_slots ({self.min_slots}) is above max_slots ({self.max_slots})"
            )
        return self

    def merged(self, overrides: dict[str, object]) -> QueuePolicy:
        """This policy with ``overrides`` applied (validated again)."""
        return QueuePolicy.model_validate({**self.model_dump(), **overrides})
