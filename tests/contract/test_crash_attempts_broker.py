"""Issue 16 F14 on the broker (Redis): the settlements a master has a live slot apply for a
slot that died. Each applies only while the dead slot's lock is still held: after a lock
expiry another slot may run the job, and settles it itself."""

from __future__ import annotations

import time

from qcluster.broker.base import QueueStats, Settlement
from qcluster.broker.redis_broker import RedisBroker


def test_crashed_refused_and_ack_held_apply_only_under_the_dead_slots_lock(
    redis_url: str, queue_name: str
) -> None:
    broker = RedisBroker.from_url(redis_url)
    try:
        broker.publish_many(queue_name, [("done", b"{}"), ("crash", b"{}"), ("refuse", b"{}")])
        taken = {d.id: d for d in broker.take(queue_name, max_jobs=3, lock_timeout_s=0.2)}
        time.sleep(0.4)  # the locks expire; another slot takes the jobs again
        again = {d.id: d for d in broker.take(queue_name, max_jobs=3, lock_timeout_s=30)}
        assert set(again) == set(taken)
        late = Settlement(ack_held=[taken["done"]], crashed=[taken["crash"]],
                          refused=[(taken["refuse"], "too late")])
        broker.settle(queue_name, late)  # the old lock: nothing happens
        assert broker.stats(queue_name) == QueueStats(locked=3)

        broker.settle(queue_name, Settlement(
            ack_held=[again["done"]], crashed=[again["crash"]],
            refused=[(again["refuse"], "taken 3 times without settling, ran 2 times")]))
        assert broker.stats(queue_name) == QueueStats(ready=1, dead=1)
        (crashed,) = broker.take(queue_name, max_jobs=1, lock_timeout_s=30)
        # take 1 expired, take 2 crashed: both counted; this is the third, suspect
        assert (crashed.id, crashed.attempts, crashed.suspect) == ("crash", 3, True)
        (dead,) = broker.dead_jobs(queue_name)
        # take 1 expired (counted); take 2 found it refused: not counted
        assert (dead.id, dead.attempts) == ("refuse", 1)
    finally:
        broker.delete_queue(queue_name)
        broker.close()
