"""A Redis take whose reply is lost, on a real Redis behind a TCP proxy (tests/tcp_proxy.py).

The take script ran (its jobs are locked) and the connection failed before its reply
reached the slot. The call is tried again with the same take token (by redis-py on a new
connection after a reset, or by the slot's next take after a timeout) and gets the jobs
that take locked: they run once, uncharged. Without the token, the retry took other jobs
(or none) and the first ones came back only at their lock's expiry, charged one attempt
and suspect, as if their slot had died running them: with ``max_attempts`` 1, dead-lettered
without having run.
"""

from __future__ import annotations

import contextlib
import time

import pytest

from qcluster.broker import open_broker
from qcluster.broker.base import Settlement
from qcluster.broker.redis_broker import RedisBroker
from qcluster.errors import BrokerUnavailable
from qcluster.job import Delivery
from tests.tcp_proxy import TcpProxy, proxied_redis

#: Short, so that the test waits little for a reply that never comes.
SOCKET_TIMEOUT_S = 1.0
#: Longer than any pause of a loaded machine between a take and the checks that follow.
LOCK_S = 60.0


def proxied(
        redis_url: str) -> contextlib.AbstractContextManager[tuple[RedisBroker, TcpProxy]]:
    """A RedisBroker through a proxy, its socket timeout short (the test waits less)."""
    return proxied_redis(redis_url, SOCKET_TIMEOUT_S)


def publish(broker: RedisBroker, queue: str, ids: list[str]) -> None:
    broker.publish_many(queue, [(job_id, b'{"payload": null}') for job_id in ids])


def fresh(deliveries: list[Delivery]) -> list[tuple[str, int, bool]]:
    return sorted((d.id, d.attempts, d.suspect) for d in deliveries)


def test_a_take_whose_reply_is_reset_hands_its_jobs_to_the_retry(
        redis_url: str, queue_name: str) -> None:
    """redis-py tries the EVALSHA again on a new connection: it gets the two jobs the
    first run locked, attempt 1, not suspect. Failed before: the retry took nothing
    ([]), and the jobs came back at their lock's expiry as attempt 2, suspect."""
    with proxied(redis_url) as (broker, proxy):
        publish(broker, queue_name, ["a", "b"])
        proxy.cut_next_reply()
        taken = broker.take(queue_name, max_jobs=10, lock_timeout_s=LOCK_S)
        assert proxy.replies_cut == 1
        assert fresh(taken) == [("a", 1, False), ("b", 1, False)]
        broker.ack(queue_name, taken)
        stats = broker.stats(queue_name)
        assert (stats.ready, stats.locked, stats.delayed, stats.dead) == (0, 0, 0, 0)


def test_a_take_whose_reply_never_comes_hands_its_jobs_to_the_next_take(
        redis_url: str, queue_name: str) -> None:
    """The reply is dropped and the link goes silent: the take raises BrokerUnavailable
    (a slot pauses, then takes again); the next take gets the jobs the lost one locked,
    uncharged, and only them. Failed before: the next take got nothing."""
    with proxied(redis_url) as (broker, proxy):
        publish(broker, queue_name, ["a", "b"])
        proxy.cut_next_reply(reset=False)
        with pytest.raises(BrokerUnavailable):
            broker.take(queue_name, max_jobs=10, lock_timeout_s=LOCK_S)
        proxy.restore()
        publish(broker, queue_name, ["c"])  # ready now: the replay must not take it
        taken = broker.take(queue_name, max_jobs=10, lock_timeout_s=LOCK_S)
        assert fresh(taken) == [("a", 1, False), ("b", 1, False)]
        broker.ack(queue_name, taken)
        again = broker.take(queue_name, max_jobs=10, lock_timeout_s=LOCK_S)
        assert fresh(again) == [("c", 1, False)]  # a new take, not the replay once more


def test_a_settle_and_take_whose_reply_is_reset_settles_once_and_hands_its_jobs_over(
        redis_url: str, queue_name: str) -> None:
    """The combined script: the settle applies (the acked job is gone), the retry gets
    the jobs the lost reply carried. Failed before: the retry took nothing."""
    with proxied(redis_url) as (broker, proxy):
        publish(broker, queue_name, ["a"])
        first = broker.take(queue_name, max_jobs=10, lock_timeout_s=LOCK_S)
        publish(broker, queue_name, ["b", "c"])
        proxy.cut_next_reply()
        taken = broker.settle_and_take(queue_name, Settlement(ack=first), max_jobs=10,
                                       lock_timeout_s=LOCK_S)
        assert proxy.replies_cut == 1
        assert fresh(taken) == [("b", 1, False), ("c", 1, False)]
        done = broker.job("a", queues=[queue_name])
        assert done is not None and done.state == "finished"
        finished = [key for key in broker.client.scan_iter(f"qc:{{{queue_name}}}:finished:*")]
        entries = [entry for key in finished for entry in broker.client.lrange(key, 0, -1)]
        assert len(entries) == 1  # settled once: the replay skipped the settle it carried


def test_a_replay_never_hands_out_jobs_whose_lock_expired(
        redis_url: str, queue_name: str) -> None:
    """The lost take's locks expire and another slot takes the jobs (charged: their take
    may have run them); the first slot's late retry must not get them too."""
    other = open_broker(redis_url)
    try:
        with proxied(redis_url) as (broker, proxy):
            publish(broker, queue_name, ["a"])
            proxy.cut_next_reply(reset=False)
            with pytest.raises(BrokerUnavailable):
                broker.take(queue_name, max_jobs=10, lock_timeout_s=0.2)
            proxy.restore()
            time.sleep(0.3)
            taken_by_other = other.take(queue_name, max_jobs=10, lock_timeout_s=LOCK_S)
            assert fresh(taken_by_other) == [("a", 2, True)]
            assert broker.take(queue_name, max_jobs=10, lock_timeout_s=LOCK_S) == []
    finally:
        other.close()


def test_a_lost_take_then_another_settlement_settles_it_and_replays_the_take(
        redis_url: str, queue_name: str) -> None:
    """The lost call was a take alone; the next call settles something too. Its settle
    must apply (a replay skips only the settle its lost call carried), and the take is
    the lost one's."""
    with proxied(redis_url) as (broker, proxy):
        publish(broker, queue_name, ["a"])
        first = broker.take(queue_name, max_jobs=1, lock_timeout_s=LOCK_S)
        publish(broker, queue_name, ["b"])
        proxy.cut_next_reply(reset=False)
        with pytest.raises(BrokerUnavailable):
            broker.take(queue_name, max_jobs=10, lock_timeout_s=LOCK_S)
        proxy.restore()
        taken = broker.settle_and_take(queue_name, Settlement(ack=first), max_jobs=10,
                                       lock_timeout_s=LOCK_S)
        assert fresh(taken) == [("b", 1, False)]
        done = broker.job("a", queues=[queue_name])
        assert done is not None and done.state == "finished"


def test_a_replayed_suspect_job_keeps_its_count(redis_url: str, queue_name: str) -> None:
    """A job whose last take ended by lock expiry is taken by a take whose reply is lost:
    the retry gets it charged once for that expiry (attempt 2, suspect), not twice."""
    with proxied(redis_url) as (broker, proxy):
        publish(broker, queue_name, ["a"])
        broker.take(queue_name, max_jobs=1, lock_timeout_s=0.05)  # its slot "dies"
        time.sleep(0.2)
        proxy.cut_next_reply()
        taken = broker.take(queue_name, max_jobs=10, lock_timeout_s=LOCK_S)
        assert proxy.replies_cut == 1
        assert fresh(taken) == [("a", 2, True)]
