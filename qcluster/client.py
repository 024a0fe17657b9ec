"""The producer API: enqueue jobs, read counts, manage dead letters."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from qcluster.broker import Broker, DeadJob, open_broker
from qcluster.job import DEFAULT_MAX_MESSAGE_BYTES, encode_new_jobs


class Client:
    """A connection to the queue server for producers and tooling.

    ``broker_url`` resolves as: the argument > ``QCLUSTER_BROKER_URL`` >
    ``qcluster.toml`` > the embedded broker under ``state_dir``.
    """

    def __init__(
        self,
        broker_url: str | None = None,
        *,
        state_dir: str | Path | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        from qcluster.config import load_settings

        settings = load_settings(None, broker_url=broker_url, state_dir=state_dir)
        self.broker: Broker = open_broker(settings.broker_url, state_dir=settings.state_dir)
        self.max_message_bytes = max_message_bytes

    def enqueue(
        self, queue: str, payload: Any, *, delay: float = 0.0, headers: dict[str, str] | None = None
    ) -> str:
        """Store one job; returns its id once the broker has it."""
        return self.enqueue_many(queue, [payload], delay=delay, headers=headers)[0]

    def enqueue_many(
        self,
        queue: str,
        payloads: Iterable[Any],
        *,
        delay: float = 0.0,
        headers: dict[str, str] | None = None,
    ) -> list[str]:
        """Store many jobs in as few round trips as the backend allows; returns their ids."""
        if delay < 0:
            raise ValueError("delay must be >= 0")
        messages = encode_new_jobs(queue, payloads, enqueued_at=time.time(), headers=headers,
                                   max_bytes=self.max_message_bytes)
        if messages:
            self.broker.publish_many(queue, messages, delay_s=delay)
        return [job_id for job_id, _ in messages]

    def stats(self, queue: str) -> dict[str, int]:
        """``{"ready", "locked", "delayed", "dead"}`` counts for the queue."""
        return self.broker.stats(queue).model_dump()

    def dead_jobs(self, queue: str, limit: int = 100) -> list[DeadJob]:
        return self.broker.dead_jobs(queue, limit=limit)

    def requeue_dead(self, queue: str) -> int:
        return self.broker.requeue_dead(queue)

    def purge(self, queue: str) -> int:
        return self.broker.purge(queue)

    def queues(self) -> list[str]:
        return self.broker.queues()

    def close(self) -> None:
        self.broker.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
