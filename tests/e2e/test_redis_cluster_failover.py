"""A Redis Cluster shard failover under load (issue 17): a real ``qcluster master`` with two
slots on ``redis+cluster://`` (3 masters, one replica each), a producer feeding one queue,
and the master of the shard holding that queue SIGKILLed while jobs wait in it. Its replica
is elected (after ``cluster-node-timeout``), RedisCluster finds the new master (MOVED, slot
map refresh), the slots carry on; the killed node is started again and rejoins as a replica.
The chaos ledger counts every acknowledged job: none may be lost (publishes WAIT for one
replica, as on Sentinel: tests/e2e/test_redis_sentinel_failover.py says why that is enough).
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import redis

from tests.brokers import PrivateRedisCluster
from tests.chaos.broker_servers import Feeder, chaos_run, close_run, completed, wait_progress
from tests.chaos.rows import new_seed
from tests.conftest import wait_until
from tests.e2e.test_redis_sentinel_failover import (
    FEED_PER_S,
    MIN_BACKLOG,
    WORK_MS,
    _backlog_of_at_least,
    _no_enqueue_error_for,
)


def _served_by_another(cluster: PrivateRedisCluster, key: str, old_port: int) -> bool:
    try:
        return cluster.master_of(key).port != old_port
    except (redis.RedisError, Exception):  # a node of the shard being elected may not answer
        return False


def test_cluster_shard_failover_under_load_loses_no_acknowledged_job(tmp_path: Path) -> None:
    cluster = PrivateRedisCluster(tmp_path / "cluster")
    cluster.start()
    run = chaos_run("redis-cluster", cluster.url, new_seed(), tmp_path / "run")
    run.procs.env["QC_CHAOS_WORK_MS"] = WORK_MS
    queue = run.q("flow")
    key = f"qc:{{{queue}}}:ready"
    feeder: Feeder | None = None
    try:
        run.start_master(f"{queue}=2")
        feeder = Feeder(run, queue, cluster.url, per_s=FEED_PER_S).start()
        wait_progress(run, 0, "the first jobs to complete")
        seen: list[int] = []
        wait_until(partial(_backlog_of_at_least, run, queue, MIN_BACKLOG, seen),
                   message=f"a backlog of {MIN_BACKLOG} before the kill")
        old = cluster.master_of(key)
        done_before = completed(run)
        killed_m = time.monotonic()
        old.kill()
        wait_until(partial(_served_by_another, cluster, key, old.port), interval_s=0.1,
                   message="the shard's replica to be elected master")
        failover_s = time.monotonic() - killed_m
        wait_progress(run, done_before, "jobs completing on the new master")
        resumed_s = time.monotonic() - killed_m
        old.restart()  # it rejoins the cluster as the new master's replica
        wait_until(lambda: cluster.synced_replicas() == cluster.masters, interval_s=0.1,
                   message="the old master back as a synced replica")
        quiet_since: list[float] = []
        wait_until(partial(_no_enqueue_error_for, feeder, 2.0, quiet_since), interval_s=0,
                   message="enqueues succeeding again")
        publishing_s = quiet_since[-1] - killed_m
        feeder.stop()
        run.wait_drained([queue])
        result = run.finish("C1", [queue], faults=1, backlog_at_kill=seen[-1],
                            failover_s=round(failover_s, 1), slots_resumed_s=round(resumed_s, 1),
                            publishing_again_s=round(publishing_s, 1))
    finally:
        if feeder is not None:
            feeder.halt()
        close_run(run)
        cluster.stop()
    print(f"cluster shard failover: replica elected after {failover_s:.1f} s, jobs completing "
          f"again after {resumed_s:.1f} s, enqueues accepted again after {publishing_s:.1f} s "
          f"(old master restarted as replica); {result.line()}")
    assert seen[-1] >= 1, "no acknowledged job waited in Redis at the kill"
    assert result.lost == 0, f"{result.lost} acknowledged jobs lost in the failover"
    assert result.unexpected == 0
    assert result.residue_total == 0, result.residue
