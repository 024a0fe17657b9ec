"""The slot's take, the pure parts: what is refused before the handler and how (a kind,
not a reason's wording), the errors of a dead slot's jobs, and when a take is followed in
the memory shared with the master."""

from __future__ import annotations

from qcluster.channel import TakeProgress
from qcluster.failures import JobError
from qcluster.job import Delivery, LockToken
from qcluster.messages import Progress
from qcluster.policy import QueuePolicy
from qcluster.slot.decode import decode_batch
from qcluster.slot.settle import DIED, give_back_settlement, settle_batch
from qcluster.slot.take_progress import TakeFollower


def _delivery(job_id: str, attempts: int = 1, body: bytes | None = None,
              malformed: str = "") -> Delivery:
    if body is None:
        body = (b'{"v":1,"id":"' + job_id.encode() + b'","queue":"q","payload":null,'
                b'"enqueued_at":1.0}')
    return Delivery(job_id, body, attempts, 1.0, 2.0, "application/json", LockToken(9),
                    malformed=malformed)


def test_taken_out_jobs_are_refused_and_malformed_ones_dead_whatever_their_reasons_say() -> None:
    policy = QueuePolicy(max_attempts=2)
    deliveries = [_delivery("ok"), _delivery("often", attempts=3),
                  _delivery("bad", body=b"not json"), _delivery("odd", malformed="taken oddly")]
    jobs, rejected = decode_batch(deliveries, policy)
    assert [job.id for job in jobs] == ["ok"]
    assert {item.delivery.id: item.kind for item in rejected} == {
        "often": "taken_out", "bad": "malformed", "odd": "malformed"}
    settlement, counters = settle_batch(jobs, policy, rand=lambda: 0.5, rejected=rejected)
    assert [d.id for d, _ in settlement.refused] == ["often"]
    assert sorted(d.id for d, _ in settlement.dead) == ["bad", "odd"]  # "taken ..." too
    assert [d.id for d in settlement.ack] == ["ok"]
    assert (counters.done, counters.failed, counters.malformed) == (1, 3, 2)


def test_a_dead_slots_running_jobs_get_the_error_given_charged_or_dead() -> None:
    jobs = [("charged", 1, 5.0, Progress.RUNNING), ("last", 3, 5.0, Progress.RUNNING),
            ("unstarted", 1, 5.0, Progress.UNSTARTED), ("failed", 1, 5.0, Progress.FAILED)]

    def died(delivery: Delivery) -> JobError:
        return JobError.bounded(type="SlotDied", message=DIED, traceback="", host="h",
                                slot="", attempt=delivery.attempts, at=1e9)

    settlement = give_back_settlement(jobs, LockToken(7), QueuePolicy(max_attempts=3),
                                      rand=lambda: 0.5, now=1e9, died=died)
    assert sorted(settlement.errors) == ["charged", "last"]
    assert [d.id for d in settlement.crashed] == ["charged"]
    assert sorted(d.id for d, _ in settlement.dead) == ["failed", "last"]


def test_a_take_is_followed_only_with_shared_memory_and_nothing_malformed() -> None:
    deliveries = [_delivery("a"), _delivery("b")]
    assert TakeFollower(None).begin("q", deliveries, per_job=False) is None
    progress = TakeProgress()
    follower = TakeFollower(progress)
    take = follower.begin("q", deliveries, per_job=False)
    assert take is not None and progress.receipt() == 9
    assert follower.begin("q", [*deliveries, _delivery("c", malformed="x")],
                          per_job=False) is None
    assert progress.receipt() is None  # cleared: the master gives nothing back
    again = follower.begin("q", deliveries, per_job=False)
    assert again is not None and progress.seq == 2
    follower.clear()
    assert progress.read() is None
