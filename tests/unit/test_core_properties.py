"""Property tests of the core's pure logic: envelope, backoff, settlement, policy."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qcluster.backoff import compute_backoff
from qcluster.errors import EnvelopeError
from qcluster.job import Delivery, Job, decode_envelope, encode_new_jobs
from qcluster.policy import QueuePolicy
from qcluster.slot.settle import settle_batch

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=20,
)


@given(payload=json_values, queue=st.from_regex(r"[a-z][a-z0-9_.-]{0,20}", fullmatch=True))
def test_any_json_payload_survives_the_envelope(payload: Any, queue: str) -> None:
    [(job_id, body)] = encode_new_jobs(queue, [payload], enqueued_at=1.5, random_bytes=os.urandom,
                                     headers={"k": "v"})
    decoded = decode_envelope(body)
    assert (decoded.id, decoded.queue, decoded.enqueued_at, decoded.headers) == (
        job_id, queue, 1.5, {"k": "v"})
    assert json.dumps(decoded.payload, sort_keys=True) == json.dumps(payload, sort_keys=True)


@given(payloads=st.lists(json_values, max_size=30), bad_at=st.integers(0, 30),
       bad=st.sampled_from([float("nan"), float("inf"), {1, 2}, b"bytes", "\ud800", object()]))
def test_a_batch_keeps_its_order_and_one_bad_payload_refuses_it_naming_which(
    payloads: list[Any], bad_at: int, bad: Any
) -> None:
    encoded = encode_new_jobs("q", payloads, enqueued_at=0.0, random_bytes=os.urandom)
    assert [json.dumps(decode_envelope(body).payload, sort_keys=True) for _, body in encoded] == [
        json.dumps(p, sort_keys=True) for p in payloads]
    ids = [job_id for job_id, _ in encoded]
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    position = min(bad_at, len(payloads))
    with_bad = [*payloads[:position], bad, *payloads[position:]]
    which = f"payload #{position}" if len(with_bad) > 1 else "payload"
    with pytest.raises(EnvelopeError, match=f"{which} for queue 'q' is not JSON"):
        encode_new_jobs("q", with_bad, enqueued_at=0.0, random_bytes=os.urandom)


@pytest.mark.parametrize("queue, headers", [("", None), ("x" * 201, None), ("q", {"k": 1})])
def test_a_bad_queue_name_or_header_is_refused(queue: str, headers: Any) -> None:
    with pytest.raises(EnvelopeError):
        encode_new_jobs(queue, [1], enqueued_at=0.0, random_bytes=os.urandom, headers=headers)


@given(body=st.binary(max_size=300))
def test_arbitrary_bytes_are_refused_with_a_reason_never_crash(body: bytes) -> None:
    try:
        decode_envelope(body)
    except EnvelopeError as exc:
        assert str(exc).startswith(("malformed", "oversized"))


@given(size=st.integers(0, 5000), limit=st.integers(64, 4000))
def test_size_limit_is_enforced_on_both_sides(size: int, limit: int) -> None:
    [(_, body)] = encode_new_jobs("q", ["x" * size], enqueued_at=0.0, random_bytes=os.urandom)
    if len(body) > limit:
        with pytest.raises(EnvelopeError, match="limit"):
            encode_new_jobs("q", ["x" * size], enqueued_at=0.0, random_bytes=os.urandom,
                            max_bytes=limit)
        with pytest.raises(EnvelopeError, match="oversized"):
            decode_envelope(body, max_bytes=limit)
    else:
        [(_, body)] = encode_new_jobs("q", ["x" * size], enqueued_at=0.0,
                                      random_bytes=os.urandom, max_bytes=limit)
        assert decode_envelope(body, max_bytes=limit)


@given(
    attempt=st.integers(1, 100), base=st.floats(0.01, 100), cap=st.floats(0.01, 10_000),
    r=st.floats(0, 1, exclude_max=True),
)
def test_backoff_is_jittered_within_half_to_full_capped_exponential(
    attempt: int, base: float, cap: float, r: float
) -> None:
    delay = compute_backoff(attempt, base_s=base, cap_s=cap, rand=lambda: r)
    ceiling = min(cap, base * 2 ** min(attempt - 1, 30))
    assert ceiling * 0.5 - 1e-9 <= delay <= ceiling + 1e-9
    assert delay > 0, "a retry never comes back immediately"


@given(attempt=st.integers(1, 40))
def test_backoff_ceiling_never_decreases(attempt: int) -> None:
    first = compute_backoff(attempt, base_s=0.5, cap_s=60, rand=lambda: 0.999)
    later = compute_backoff(attempt + 1, base_s=0.5, cap_s=60, rand=lambda: 0.999)
    assert later >= first


outcomes = st.sampled_from([None, "done", "retry", "fail", "error"])


def make_jobs(specs: list[tuple[str | None, int]]) -> list[Job]:
    jobs = []
    for n, (outcome, attempts) in enumerate(specs):
        delivery = Delivery(id=f"j{n}", body=b"{}", attempts=attempts, activate_at=0,
                            taken_at=0)
        job = Job(id=f"j{n}", queue="q", payload=n, attempts=attempts, enqueued_at=0,
                  activate_at=0, delivery=delivery)
        if outcome == "retry":
            job.retry(2.0)
        elif outcome == "fail":
            job.fail("no")
        elif outcome == "error":
            job.mark_error(ValueError("boom"))
        elif outcome == "done":
            job.outcome = "done"
        jobs.append(job)
    return jobs


@settings(max_examples=200)
@given(
    specs=st.lists(st.tuples(outcomes, st.integers(1, 8)), max_size=30),
    on_error=st.sampled_from(["retry", "lock"]), max_attempts=st.integers(1, 6),
    r=st.floats(0, 1, exclude_max=True),
)
def test_every_job_is_settled_exactly_once_by_its_outcome(
    specs: list[tuple[str | None, int]], on_error: str, max_attempts: int, r: float
) -> None:
    policy = QueuePolicy(on_error=on_error, max_attempts=max_attempts)  # type: ignore[arg-type]
    jobs = make_jobs(specs)
    settlement, counters = settle_batch(jobs, policy, rand=lambda: r)

    settled = [d.id for d in settlement.ack] + [d.id for d, _ in settlement.postpone] + [
        d.id for d, _ in settlement.dead
    ]
    assert len(settled) == len(set(settled)), "a job was settled twice"
    for job in jobs:
        if job.outcome == "error" and on_error == "lock":
            assert job.id not in settled, "on_error=lock leaves the job locked"
        else:
            assert job.id in settled, f"{job.outcome} job {job.id} was not settled"
    for job in jobs:
        if job.outcome == "error" and on_error == "retry" and job.attempts >= max_attempts:
            reason = dict((d.id, why) for d, why in settlement.dead)[job.id]
            assert "ValueError: boom" in reason
    assert counters.done == len(settlement.ack)
    assert counters.retried == len(settlement.postpone)
    assert counters.failed == len(settlement.dead)
    assert all(delay > 0 for _, delay in settlement.postpone)


@given(lock=st.floats(0.1, 1000), batch=st.floats(0.1, 1000))
def test_lock_timeout_must_exceed_batch_timeout(lock: float, batch: float) -> None:
    # The kill margin (issue 15): see tests/unit/test_policy_hardening_security.py.
    if lock >= batch + max(1.0, 0.1 * batch):
        assert QueuePolicy(lock_timeout=lock, batch_timeout=batch).lock_timeout == lock
    elif lock <= batch:
        with pytest.raises(ValueError, match="must be at least batch_timeout"):
            QueuePolicy(lock_timeout=lock, batch_timeout=batch)
