"""Issue 16 F14, the pure part: how a dead slot's take is settled from its progress
states (slot/settle.py give_back_settlement) and when its master asks for it
(master/slots.py give_back), read from the shared TakeProgress the slot wrote."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from qcluster.channel import MAX_PACKET_BYTES, TakeProgress
from qcluster.job import Delivery
from qcluster.master.pool import _in_packets
from qcluster.master.slots import give_back
from qcluster.messages import GiveBack, Progress
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
    settled = ([d.id for d in settlement.ack_held] + [d.id for d in settlement.release]
               + [d.id for d in settlement.crashed] + [d.id for d, _ in settlement.postpone]
               + [d.id for d, _ in settlement.dead])
    assert sorted(settled) == sorted(job_id for job_id, *_ in jobs)  # each exactly once
    state = {job_id: s for job_id, _, _, s in jobs}
    attempts = {job_id: a for job_id, a, _, _ in jobs}
    assert all(state[d.id] == Progress.UNSTARTED for d in settlement.release)
    assert all(state[d.id] == Progress.DONE for d in settlement.ack_held)
    assert not settlement.ack  # a done job is acked only while its lock is still held
    for delivery in settlement.crashed:  # charged, not yet at the limit
        assert state[delivery.id] == Progress.RUNNING and attempts[delivery.id] < max_attempts
    for delivery, _ in settlement.dead:  # never an unstarted or a done job
        assert state[delivery.id] in (Progress.RUNNING, Progress.RAN, Progress.FAILED)
        assert state[delivery.id] == Progress.FAILED or attempts[delivery.id] >= max_attempts
    assert all(d.receipt == 1234 for d in settlement.release + settlement.crashed)


def test_with_on_error_lock_the_running_job_is_left_to_its_lock_expiry() -> None:
    jobs = [("a", 1, 5.0, Progress.RUNNING), ("b", 1, 5.0, Progress.UNSTARTED)]
    settlement = give_back_settlement(jobs, 7, QueuePolicy(on_error="lock"),
                                      rand=lambda: 0.5, now=1e9)
    assert not settlement.crashed and not settlement.dead
    assert [d.id for d in settlement.release] == ["b"]


def test_a_take_reads_back_as_written_with_each_jobs_state() -> None:
    progress = TakeProgress()
    deliveries = [Delivery(f"id-{n}", b"", n + 1, 1e9 + n, 1e9, "application/json", 77)
                  for n in range(5)]
    assert progress.read() is None
    assert progress.begin(3, "q", 77, deliveries)
    progress.states[0], progress.states[1] = Progress.DONE, Progress.RUNNING
    taken = progress.read()
    assert taken is not None and (taken.queue, taken.receipt) == ("q", 77)
    assert taken.jobs == [(f"id-{n}", n + 1, 1e9 + n, state) for n, state in enumerate(
        [Progress.DONE, Progress.RUNNING] + [Progress.UNSTARTED] * 3)]
    assert progress.begin(4, "q", 78, deliveries[:2])  # a new take: all unstarted again
    taken = progress.read()
    assert taken is not None and [job[3] for job in taken.jobs] == [Progress.UNSTARTED] * 2
    progress.clear()
    assert progress.read() is None
    too_many = deliveries * (TakeProgress.CAPACITY // 5 + 1)
    assert not progress.begin(5, "q", 79, too_many) and progress.read() is None


def test_a_take_is_given_back_only_when_its_slot_died() -> None:
    taken = GiveBack(queue="q", receipt=99, jobs=[("a", 1, 5.0, Progress.RUNNING)])
    assert give_back("crash", taken) is taken
    assert give_back("hung", taken) is taken and give_back("memory", taken) is taken
    assert give_back("recycle", taken) is None  # it settled its take itself
    assert give_back(None, taken) is None
    assert give_back("crash", None) is None


def test_ids_of_any_text_read_back_and_a_big_give_back_goes_in_parts_that_fit_a_packet(
) -> None:
    """Sizes are bytes as JSON writes them: 200 ids of 200 emoji (800 bytes each in UTF-8,
    2,400 as JSON escapes) still go in packets under 64 KiB."""
    ids = [f"{n}-" + "\N{GRINNING FACE}" * 200 for n in range(200)]
    deliveries = [Delivery(job_id, b"", 1, 1e9, 1e9, "application/json", 5) for job_id in ids]
    progress = TakeProgress()
    assert progress.begin(1, "q", 5, deliveries)
    taken = progress.read()
    assert taken is not None and [job[0] for job in taken.jobs] == ids
    parts = _in_packets(taken)
    assert len(parts) > 1 and [job for part in parts for job in part.jobs] == taken.jobs
    assert all(len(part.model_dump_json().encode()) <= MAX_PACKET_BYTES for part in parts)
