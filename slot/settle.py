"""From a batch's outcomes to broker operations (pure).

The decisions a slot makes after its handler returned (or raised): which jobs are
acked, which come back later and when, which go to the dead-letter store and why.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from qcluster.backoff import compute_backoff
from qcluster.broker.base import DeadRetention, Settlement
from qcluster.job import Delivery, Job
from qcluster.messages import BatchCounters
from qcluster.policy import QueuePolicy


def dead_retention(policy: QueuePolicy) -> DeadRetention:
    """The queue's dead-letter retention, passed to the broker with each settlement."""
    return DeadRetention(policy.dead_max_count, policy.dead_max_age)


def settle_batch(
    jobs: Sequence[Job],
    policy: QueuePolicy,
    *,
    rand: Callable[[], float],
    rejected: Sequence[tuple[Delivery, str]] = (),
    malformed: int = 0,
    busy_s: float = 0.0,
) -> tuple[Settlement, BatchCounters]:
    """Settlement for ``jobs`` after their handler ran, plus the counters to report.

    Parameters:
        jobs: the batch; each with ``outcome`` None/"done" (ack), "retry" (postpone),
            "fail" (dead), or "error" (the handler raised: on_error decides).
        rejected: deliveries refused before the handler (malformed, not JSON, too many
            attempts) with their reasons; they go to the dead-letter store.
        malformed: how many of ``rejected`` were not valid envelopes (for the counter).
        rand: a float in [0, 1) for backoff jitter.
    """
    settlement = Settlement(dead=list(rejected), retention=dead_retention(policy))
    done = retried = failed = 0
    for job in jobs:
        assert job.delivery is not None
        if job.outcome in (None, "done"):
            settlement.ack.append(job.delivery)
            done += 1
        elif job.outcome == "retry":
            settlement.postpone.append((job.delivery, job.retry_delay_s))
            retried += 1
        elif job.outcome == "fail":
            settlement.dead.append((job.delivery, job.fail_reason or "failed by handler"))
            failed += 1
        elif policy.on_error == "lock":
            continue  # the original design: leave it locked; it returns at lock expiry
        elif job.attempts >= policy.max_attempts:
            reason = f"{job.error} (gave up after {job.attempts} attempts)"
            settlement.dead.append((job.delivery, reason))
            failed += 1
        else:
            delay = compute_backoff(
                job.attempts, base_s=policy.retry_base_delay, cap_s=policy.retry_max_delay,
                rand=rand,
            )
            settlement.postpone.append((job.delivery, delay))
            retried += 1
    counters = BatchCounters(
        done=done, retried=retried, failed=failed + len(rejected), malformed=malformed,
        batches=1, busy_s=busy_s,
    )
    return settlement, counters
