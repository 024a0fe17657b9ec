"""From a take's deliveries to the jobs a handler gets, and what is refused before it."""

from __future__ import annotations

from collections.abc import Sequence

from qcluster.errors import EnvelopeError
from qcluster.job import JSON_CONTENT_TYPE, Delivery, Job, decode_envelope
from qcluster.policy import QueuePolicy
from qcluster.slot.settle import Rejected, taken_out


def decode_batch(deliveries: Sequence[Delivery],
                 policy: QueuePolicy) -> tuple[list[Job], list[Rejected]]:
    """The jobs to run, and the deliveries refused: malformed ones, and those taken more
    often than ``max_attempts`` without being settled."""
    jobs: list[Job] = []
    rejected: list[Rejected] = []
    for delivery in deliveries:
        try:
            if delivery.content_type != JSON_CONTENT_TYPE or delivery.malformed:
                raise EnvelopeError(
                    delivery.malformed or f"refused content type {delivery.content_type!r}")
            envelope = decode_envelope(delivery.body, max_bytes=policy.max_message_bytes)
            job = Job.from_delivery(delivery, envelope)
        except EnvelopeError as exc:
            rejected.append(Rejected(delivery, str(exc), "malformed"))
            continue
        except Exception as exc:  # never die of input: whatever it is, it is malformed
            rejected.append(Rejected(
                delivery, f"malformed: {type(exc).__name__}: {exc}"[:1000], "malformed"))
            continue
        if delivery.attempts > policy.max_attempts:
            # Taken more often than allowed without ever being settled: its slots
            # died or hung on it. Running it again would likely kill this one too.
            rejected.append(Rejected(delivery, taken_out(delivery.attempts, policy),
                                     "taken_out"))
            continue
        jobs.append(job)
    return jobs, rejected
