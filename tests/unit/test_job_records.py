"""The pure parts of job lookup: the finished records' run-length encoding of a settle's
acks (what settle.lua expands back, job by job), and a job's JSON."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from qcluster.broker.base import DeadRetention
from qcluster.broker.redis_scripts import finished_args
from qcluster.job import Delivery
from qcluster.jobs import JobInfo, payload_of

acks = st.lists(st.tuples(st.sampled_from([1.5, 2.25, 1e9]), st.integers(1, 4)),
                min_size=1, max_size=60)


def expand(args: list[object], count: int) -> list[tuple[int, int]]:
    """What settle.lua does with the finished section: each ack's (taken_ms, attempts)."""
    keep, cap, n_runs, *runs = args
    assert keep == 300_000 and cap == 12_500 and len(runs) == 3 * int(str(n_runs))
    out: list[tuple[int, int]] = []
    for r in range(0, len(runs), 3):
        taken, attempts, n = (int(str(v)) for v in runs[r:r + 3])
        out += [(taken, attempts)] * n
    assert len(out) == count
    return out


@given(acks)
def test_the_runs_give_each_ack_its_take_and_attempts(pairs: list[tuple[float, int]]) -> None:
    deliveries = [Delivery(f"id{n}", b"{}", attempts, 0.0, taken)
                  for n, (taken, attempts) in enumerate(pairs)]
    args = finished_args(deliveries, DeadRetention(keep_finished_s=300))
    assert expand(args, len(pairs)) == [(round(t * 1000), a) for t, a in pairs]


def test_no_section_when_the_queue_keeps_nothing_or_nothing_was_acked() -> None:
    one = [Delivery("a", b"{}", 1, 0.0, 1.0)]
    assert finished_args(one, DeadRetention(keep_finished_s=0)) == []
    assert finished_args([], DeadRetention()) == []


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(),
                    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner),
                    max_leaves=10))
def test_a_payload_is_read_back_from_its_envelope(payload: object) -> None:
    import json

    body = json.dumps({"v": 1, "id": "x", "queue": "q", "payload": payload, "enqueued_at": 1.0})
    assert payload_of(body.encode()) == payload
    assert payload_of(b"not json") is None and payload_of(None) is None


def test_the_lock_token_is_never_shown() -> None:
    info = JobInfo(id="a", state="running", lock_token=123)
    assert "lock_token" not in info.model_dump() and "lock_token" not in info.model_dump_json()
