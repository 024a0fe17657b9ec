"""A Sentinel failover under load (issue 17): a real ``qcluster master`` with two slots on
``redis+sentinel://``, a producer feeding it, the Redis master SIGKILLed while jobs wait in
it. The Sentinels promote the replica, the slots carry on against it, the killed server is
started again (as a supervisor would) and rejoins as a replica. The chaos ledger then counts
every job the producer saw acknowledged: none may be lost.

Why none can be: a publish returns only once a replica holds its jobs (``WAIT``, the URL's
``replicas=1`` default), and Sentinel promotes that replica. Takes and settles do not wait:
an ack the dead master had not passed on makes its job run again (at least once, never lost).
With one replica, publishes fail (the producer sees BrokerUnavailable and retries) from the
kill until the old master is back as a replica: there is no second replica to WAIT for.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import pytest
import redis

from qcluster.broker import open_broker
from qcluster.errors import BrokerUnavailable
from tests.brokers import PrivateRedisSentinel
from tests.chaos.broker_servers import (
    Feeder,
    backlog,
    chaos_run,
    close_run,
    completed,
    wait_progress,
)
from tests.chaos.rows import new_seed
from tests.conftest import wait_until

#: Each job's work (ms): 2 slots drain ~200 jobs/s, below the feed's 300/s, so acknowledged
#: jobs wait in Redis when its master is killed.
WORK_MS = "10"
FEED_PER_S = 300.0
MIN_BACKLOG = 20


def _backlog_of_at_least(run: object, queue: str, least: int, seen: list[int]) -> bool:
    seen.append(backlog(run, queue))  # type: ignore[arg-type]
    return seen[-1] >= least


def _new_master(sentinel: PrivateRedisSentinel, old_port: int) -> bool:
    try:
        return sentinel.master_port() != old_port
    except Exception:  # a Sentinel busy electing may not answer yet
        return False


@pytest.mark.parametrize("replicas", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_sentinel_failover_under_load_loses_no_acknowledged_job(
    replicas: int, tmp_path: Path
) -> None:
    """With one replica the killed master is restarted (publishes wait for it: WAIT 1 has
    no other replica); with two, nothing is restarted: the Sentinels point the second
    replica at the new master and publishes go on once it has synced."""
    sentinel = PrivateRedisSentinel(tmp_path / "sentinel", replicas=replicas)
    sentinel.start()
    seed = new_seed()
    run = chaos_run("redis-sentinel", sentinel.url, seed, tmp_path / "run")
    run.procs.env["QC_CHAOS_WORK_MS"] = WORK_MS
    queue = run.q("flow")
    feeder: Feeder | None = None
    try:
        run.start_master(f"{queue}=2")
        feeder = Feeder(run, queue, sentinel.url, per_s=FEED_PER_S).start()
        wait_progress(run, 0, "the first jobs to complete")
        seen: list[int] = []
        wait_until(partial(_backlog_of_at_least, run, queue, MIN_BACKLOG, seen),
                   message=f"a backlog of {MIN_BACKLOG} before the kill")
        old = sentinel.master()
        done_before = completed(run)
        killed_m = time.monotonic()
        old.kill()
        wait_until(partial(_new_master, sentinel, old.port), interval_s=0.1,
                   message="the Sentinels to promote the replica")
        failover_s = time.monotonic() - killed_m
        wait_progress(run, done_before, "jobs completing on the new master")
        resumed_s = time.monotonic() - killed_m
        if replicas == 1:
            old.restart()  # Sentinel turns it into a replica of the new master
        wait_until(lambda: sentinel.replica_count() >= 1, interval_s=0.1,
                   message="a replica for the new master")
        quiet_since: list[float] = []
        wait_until(partial(_no_enqueue_error_for, feeder, 2.0, quiet_since), interval_s=0,
                   message="enqueues succeeding again")
        publishing_s = quiet_since[-1] - killed_m
        feeder.stop()
        run.wait_drained([queue])
        result = run.finish(f"S1-{replicas}r", [queue], faults=1, backlog_at_kill=seen[-1],
                            failover_s=round(failover_s, 1), slots_resumed_s=round(resumed_s, 1),
                            publishing_again_s=round(publishing_s, 1))
    finally:
        if feeder is not None:
            feeder.halt()
        close_run(run)
        sentinel.stop()
    print(f"sentinel failover, {replicas} replica(s): promoted after {failover_s:.1f} s, jobs "
          f"completing again after {resumed_s:.1f} s, enqueues accepted again after "
          f"{publishing_s:.1f} s; {result.line()}")
    assert seen[-1] >= 1, "no acknowledged job waited in Redis at the kill"
    assert result.lost == 0, f"{result.lost} acknowledged jobs lost in the failover"
    assert result.unexpected == 0
    assert result.residue_total == 0, result.residue


def _no_enqueue_error_for(feeder: Feeder, window_s: float, started: list[float]) -> bool:
    """True if the feeder's enqueues raised nothing for ``window_s`` (its start kept)."""
    started.append(time.monotonic())
    errors = len(feeder.producer.errors)
    time.sleep(window_s)
    return len(feeder.producer.errors) == errors


def test_what_a_failover_loses_without_wait_and_what_wait_refuses(tmp_path: Path) -> None:
    """Asynchronous replication, shown: with the replica cut off from its master (it tries
    to reconnect with a wrong password: a lagging or partitioned replica), a publish with
    ``replicas=0`` returns and its jobs are lost when the master dies and the replica is
    promoted; with ``replicas=1`` the publish raises instead (the producer knows to publish
    again). Jobs published while the replica kept up survive either way."""
    sentinel = PrivateRedisSentinel(tmp_path / "sentinel")
    sentinel.start()
    queue = "sentinel-loss"
    no_wait = open_broker(f"{sentinel.url}?replicas=0")
    waiting = open_broker(f"{sentinel.url}?replica_timeout_ms=500")
    try:
        waiting.publish_many(queue, [("kept-1", b"{}"), ("kept-2", b"{}")])
        old = sentinel.master()
        replica = next(server for server in sentinel.servers if server is not old)
        _cut_off(replica.port, old.port)
        no_wait.publish_many(queue, [("acked-then-lost", b"{}")])
        with pytest.raises(BrokerUnavailable, match="0 of 1 replica"):
            waiting.publish_many(queue, [("refused", b"{}")])
        old.kill()
        with redis.Redis(port=replica.port, socket_timeout=5) as client:
            client.config_set("masterauth", "")
        wait_until(partial(_new_master, sentinel, old.port), interval_s=0.1,
                   message="the Sentinels to promote the replica")
        after = open_broker(f"{sentinel.url}?replicas=0")
        try:
            ids = {d.id for d in after.take(queue, max_jobs=10, lock_timeout_s=30)}
        finally:
            after.close()
    finally:
        no_wait.close()
        waiting.close()
        sentinel.stop()
    assert ids == {"kept-1", "kept-2"}, f"after the failover the queue holds {sorted(ids)}"


def _cut_off(replica_port: int, master_port: int) -> None:
    """Drop the replica's link and keep it down: it reconnects with a password the master
    refuses (Sentinel does not touch masterauth, so it does not mend this)."""
    with redis.Redis(port=replica_port, socket_timeout=5) as replica:
        replica.config_set("masterauth", "wrong")
        with redis.Redis(port=master_port, socket_timeout=5) as master:
            master.client_kill_filter(_type="replica")
        wait_until(lambda: replica.info("replication").get("master_link_status") == "down",
                   interval_s=0.05, message="the replica's link down")


@pytest.mark.slow  # ~20 s; the SIGKILL failover above is the core row
def test_a_switchover_loses_no_acknowledged_publish(tmp_path: Path) -> None:
    """``SENTINEL FAILOVER`` (maintenance: the master is alive and becomes a replica) while
    a producer publishes one job at a time: the client follows the new master (the old
    one answers READONLY, the connection is dropped and the retry asks the Sentinels), and
    every publish that returned is in the queue afterwards. A publish the old master took
    after its replica was promoted cannot be acknowledged: WAIT finds no replica."""
    sentinel = PrivateRedisSentinel(tmp_path / "sentinel", down_after_ms=5000)
    sentinel.start()
    queue = "switchover"
    broker = open_broker(f"{sentinel.url}?replica_timeout_ms=1000")
    acknowledged: list[str] = []
    refused = 0
    try:
        old_port = sentinel.master_port()
        with redis.Redis(port=sentinel.sentinels[0].port, socket_timeout=5) as client:
            client.execute_command("SENTINEL", "FAILOVER", sentinel.service)
        after_switch = 0
        deadline = time.monotonic() + 120
        number = 0
        while after_switch < 50 and time.monotonic() < deadline:
            number += 1
            try:
                broker.publish_many(queue, [(f"job-{number}", b"{}")])
                acknowledged.append(f"job-{number}")
            except BrokerUnavailable:
                refused += 1
                time.sleep(0.05)
            if _new_master(sentinel, old_port):
                after_switch += 1
        assert after_switch >= 50, "the Sentinels did not switch the master over"
        wait_until(lambda: sentinel.replica_count() >= 1, message="the old master a replica")
        taken: set[str] = set()
        while batch := broker.take(queue, max_jobs=500, lock_timeout_s=60):
            taken |= {delivery.id for delivery in batch}
    finally:
        broker.close()
        sentinel.stop()
    print(f"switchover: {len(acknowledged)} publishes acknowledged, {refused} refused")
    assert set(acknowledged) <= taken, f"lost: {sorted(set(acknowledged) - taken)[:10]}"
