"""Issue 16 F14, the pure part: how a dead slot's take is settled from its progress
states (slot/settle.py give_back_settlement) and when its master asks for it
(master/slots.py give_back)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from qcluster.master.slots import SlotRecord, give_back
from qcluster.messages import HeldTake, Progress
from qcluster.policy import QueuePolicy
from qcluster.slot.settle import give_back_settlement

STATES = (Progress.UNSTARTED, Progress.RUNNING, Progress.DONE, Progress.RAN, Progress.FAILED)
held_jobs = st.lists(st.tuples(st.uuids().map(str), st.integers(1, 8),
                               st.floats(0, 2e9), st.sampled_from(STATES)),
                     max_size=30, unique_by=lambda job: job[0])


@given(held_jobs, st.integers(1, 6))
def test_only_jobs_that_ran_are_charged_and_each_is_settled_once(
    jobs: list[tuple[str, int, float, int]], max_attempts: int
) -> None:
    policy = QueuePolicy(max_attempts=max_attempts)
    settlement = give_back_settlement(jobs, 1234, policy, rand=lambda: 0.5, now=1e9)
    settled = ([d.id for d in settlement.ack] + [d.id for d in settlement.release]
               + [d.id for d in settlement.crashed] + [d.id for d, _ in settlement.postpone]
               + [d.id for d, _ in settlement.dead])
    assert sorted(settled) == sorted(job_id for job_id, *_ in jobs)  # each exactly once
    state = {job_id: s for job_id, _, _, s in jobs}
    attempts = {job_id: a for job_id, a, _, _ in jobs}
    assert all(state[d.id] == Progress.UNSTARTED for d in settlement.release)
    assert all(state[d.id] == Progress.DONE for d in settlement.ack)
    for delivery in settlement.crashed:  # charged, not yet at the limit
        assert state[delivery.id] == Progress.RUNNING and attempts[delivery.id] < max_attempts
    for delivery, _ in settlement.dead:  # never an unstarted or a done job
        assert state[delivery.id] in (Progress.RUNNING, Progress.RAN, Progress.FAILED)
        assert state[delivery.id] == Progress.FAILED or attempts[delivery.id] >= max_attempts
    assert all(d.receipt == 1234 for d in settlement.release + settlement.crashed)


def held(seq: int) -> HeldTake:
    return HeldTake(seq=seq, queue="q", receipt=99, jobs=[("a", 1, 5.0), ("b", 2, 6.0)])


def test_a_slot_that_died_holding_its_announced_take_is_given_back() -> None:
    slot = SlotRecord(0, 123, "q", 0.0, 0.0, 0.0, held=held(7))
    order = give_back(slot, "crash", 7, bytes([Progress.RUNNING, Progress.UNSTARTED]))
    assert order is not None and order.receipt == 99
    assert order.jobs == [("a", 1, 5.0, Progress.RUNNING), ("b", 2, 6.0, Progress.UNSTARTED)]


def test_nothing_is_given_back_for_a_clean_exit_an_older_take_or_no_take() -> None:
    slot = SlotRecord(0, 123, "q", 0.0, 0.0, 0.0, held=held(7))
    states = bytes([Progress.DONE, Progress.DONE])
    assert give_back(slot, "recycle", 7, states) is None  # it settled its take itself
    assert give_back(slot, None, 7, states) is None
    assert give_back(slot, "crash", 8, states) is None  # a newer take it never announced
    assert give_back(SlotRecord(0, 123, "q", 0.0, 0.0, 0.0), "hung", 7, states) is None
