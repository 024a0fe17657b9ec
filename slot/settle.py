"""From a batch's outcomes to broker operations (pure).

The decisions a slot makes after its handler returned (or raised): which jobs are
acked, which come back later and when, which go to the dead-letter store and why.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from qcluster.backoff import compute_backoff
from qcluster.broker.base import DeadRetention, Settlement
from qcluster.failures import JobError
from qcluster.job import JSON_CONTENT_TYPE, Delivery, Job, LockToken
from qcluster.messages import BatchCounters, Progress
from qcluster.policy import QueuePolicy

RejectionKind = Literal["malformed", "taken_out"]


@dataclass(slots=True)
class Rejected:
    """A delivery refused before its handler, and why."""

    delivery: Delivery
    reason: str
    kind: RejectionKind
    """``malformed``: not a valid envelope (dead-lettered: that take was its attempt);
    ``taken_out``: taken more often than ``max_attempts`` without being settled (its
    slots died or hung on it), dead-lettered as refused: that take was no attempt."""


def dead_retention(policy: QueuePolicy) -> DeadRetention:
    """The queue's dead-letter retention, passed to the broker with each settlement."""
    return DeadRetention(policy.dead_max_count, policy.dead_max_age, policy.keep_finished_s)


def settle_batch(
    jobs: Sequence[Job],
    policy: QueuePolicy,
    *,
    rand: Callable[[], float],
    rejected: Sequence[Rejected] = (),
    busy_s: float = 0.0,
    batch_s: float = 0.0,
) -> tuple[Settlement, BatchCounters]:
    """Settlement for ``jobs`` after their handler ran, plus the counters to report.

    Parameters:
        jobs: the batch; each with ``outcome`` None/"done" (ack), "retry" (postpone),
            "fail" (dead), or "error" (the handler raised: on_error decides).
        rejected: deliveries refused before the handler (malformed, not JSON, too many
            takes) with their reasons; they go to the dead-letter store.
        rand: a float in [0, 1) for backoff jitter.
        busy_s, batch_s: the handler's seconds and the batch's (counters.BatchCounters).
    """
    settlement = Settlement(retention=dead_retention(policy))
    malformed = 0
    for item in rejected:
        if item.kind == "malformed":
            settlement.dead.append((item.delivery, item.reason))
            malformed += 1
        else:
            settlement.refused.append((item.delivery, item.reason))
    done = retried = failed = 0
    for job in jobs:
        assert job.delivery is not None
        if job.outcome in (None, "done"):
            settlement.ack.append(job.delivery)
            done += 1
        elif job.outcome == "retry" and job.attempts >= policy.max_attempts:
            # Taken again, it would be refused as taken too often: say why now, plainly.
            settlement.dead.append((job.delivery, retried_out(job.attempts, policy)))
            failed += 1
        elif job.outcome == "retry":
            settlement.postpone.append((job.delivery, job.retry_delay_s))
            retried += 1
        elif job.outcome == "fail":
            settlement.dead.append((job.delivery, job.fail_reason or "failed by handler"))
            failed += 1
        elif policy.on_error == "lock":
            continue  # the original design: leave it locked; it returns at lock expiry
        elif job.attempts >= policy.max_attempts:
            settlement.dead.append((job.delivery, raised_out(job.attempts, policy, job.error)))
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
        batches=1, busy_s=busy_s, batch_s=batch_s,
    )
    return settlement, counters


def give_back_settlement(
    jobs: Sequence[tuple[str, int, float, int]],
    receipt: LockToken,
    policy: QueuePolicy,
    *,
    rand: Callable[[], float],
    now: float,
    died: Callable[[Delivery], JobError] | None = None,
) -> Settlement:
    """How to settle the jobs a slot held when it died, by how far it got with each
    (``(id, attempts, activate_at, Progress state)``, see messages.GiveBack).

    UNSTARTED jobs go back uncharged; the RUNNING one (what killed the slot, or what it
    was killed during) is charged and suspect, or dead-lettered once it has run
    ``max_attempts`` times; DONE ones are acked (their work is done); RAN ones (a retry
    or an error) are charged as their outcome said, with the policy's backoff (an
    explicit ``job.retry(delay)`` is not known here); FAILED ones are dead-lettered.
    ``died``: the error recorded with each job its slot died running (charged or dead).
    """
    settlement = Settlement(retention=dead_retention(policy))
    limit = policy.max_attempts
    for job_id, attempts, activate_at, state in jobs:
        delivery = Delivery(job_id, b"", attempts, activate_at, now, JSON_CONTENT_TYPE, receipt)
        if state == Progress.DONE:
            settlement.ack_held.append(delivery)
        elif state == Progress.UNSTARTED:
            settlement.release.append(delivery)
        elif state == Progress.RUNNING and policy.on_error == "lock":
            continue  # the policy keeps failing jobs locked: it returns at lock expiry
        elif state == Progress.RUNNING:
            if attempts >= limit:
                settlement.dead.append((delivery, f"{DIED} on attempt {attempts} of {limit} "
                                        f"and no attempt is left (max_attempts {limit})"))
            else:
                settlement.crashed.append(delivery)
            if died is not None:
                settlement.errors[delivery.id] = died(delivery)
        elif state == Progress.FAILED:
            settlement.dead.append((delivery, "failed by the handler (job.fail(); settled for "
                                    "its slot, which died before settling)"))
        elif policy.on_error == "lock":
            continue  # as settle_batch: it returns when its lock expires
        elif attempts >= limit:
            settlement.dead.append((delivery, f"attempt {attempts} of {limit} raised or asked "
                                    "for a retry and no attempt is left (max_attempts "
                                    f"{limit}; settled for its slot, which died before "
                                    "settling)"))
        else:
            delay = compute_backoff(attempts, base_s=policy.retry_base_delay,
                                    cap_s=policy.retry_max_delay, rand=rand)
            settlement.postpone.append((delivery, delay))
    return settlement


DIED = "its slot died while running it"


def raised_out(attempts: int, policy: QueuePolicy, error: str) -> str:
    """The dead-letter reason of a job whose handler raised on its last attempt."""
    limit = policy.max_attempts
    return (f"attempt {attempts} of {limit} raised and no attempt is left "
            f"(max_attempts {limit}): last error {error}")


def retried_out(attempts: int, policy: QueuePolicy) -> str:
    """The dead-letter reason of a job whose handler called ``job.retry()`` on its last
    attempt (each retry uses an attempt)."""
    limit = policy.max_attempts
    return (f"the handler asked for a retry (job.retry()) on attempt {attempts} of {limit} "
            f"and no attempt is left (max_attempts {limit}: each retry uses an attempt)")


def taken_out(takes: int, policy: QueuePolicy) -> str:
    """The dead-letter reason of a job taken more often than ``max_attempts`` without
    being settled: its slots died or hung on it (or ``on_error="lock"`` left it locked)."""
    why = ("left locked after its handler raised (on_error lock), or its slot died or hung"
           if policy.on_error == "lock" else "its slot died or hung while running it")
    return (f"taken {takes} times without being settled: {why} (ran {takes - 1} times, "
            f"max_attempts {policy.max_attempts})")
