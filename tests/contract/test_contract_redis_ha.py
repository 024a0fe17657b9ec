"""The queue-server contract (test_contract.py) on Redis past one server: a master found
through Sentinel, and a Redis Cluster. The same test functions, another ``broker_url``.

Each variant starts its servers once per session (tests/brokers.py): Sentinel is one master,
one replica and three Sentinels; Cluster is three masters with one replica each. Both
publish with ``WAIT`` for one replica (the URL's default).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from qcluster.broker import Settlement, open_broker
from qcluster.broker.redis_broker import RedisBroker
from qcluster.errors import ConfigError
from tests.brokers import BrokerUnavailable, PrivateRedisCluster, PrivateRedisSentinel
from tests.contract.test_contract import *  # noqa: F403 (the contract's tests, run here again)
from tests.contract.test_contract import publish

HA_BACKENDS = ["sentinel", "cluster"]


def _started(server: PrivateRedisSentinel | PrivateRedisCluster) -> str:
    try:
        return server.start()
    except BrokerUnavailable as error:
        reason = str(error)
    pytest.fail(reason, pytrace=False)


@pytest.fixture(scope="session")
def redis_sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRedisSentinel]:
    # Slow to fail over: a busy CPU must not make a Sentinel think the master died.
    sentinel = PrivateRedisSentinel(Path(tmp_path_factory.mktemp("redis-sentinel")),
                                    down_after_ms=10000)
    _started(sentinel)
    try:
        yield sentinel
    finally:
        sentinel.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRedisCluster]:
    cluster = PrivateRedisCluster(Path(tmp_path_factory.mktemp("redis-cluster")),
                                  node_timeout_ms=10000)
    _started(cluster)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(params=HA_BACKENDS)
def broker_url(request: pytest.FixtureRequest) -> str:
    """Overrides tests/conftest.py's: each contract test runs on Sentinel and on Cluster.
    A publish waits up to 10 s for its replica: on a saturated CPU a replica can take
    seconds to acknowledge, which is not what these tests are about."""
    return str(request.getfixturevalue(f"redis_{request.param}").url) + "?replica_timeout_ms=4500"


def test_queues_spread_over_the_shards_and_are_all_listed(
    redis_cluster: PrivateRedisCluster, queue_name: str
) -> None:
    """On a cluster each queue lives on the shard of its name's hash slot, and queues()
    reads every shard's registries: all of them are listed."""
    broker = open_broker(redis_cluster.url)
    names = [f"{queue_name}-{number}" for number in range(12)]
    try:
        for name in names:
            publish(broker, name, 1)
        shards = {redis_cluster.master_of(f"qc:{{{name}}}:ready").port for name in names}
        assert len(shards) > 1, "12 queue names all hashed to one shard"
        assert set(names) <= set(broker.queues())
        broker.delete_queue(names[0])
        assert names[0] not in broker.queues()
    finally:
        for name in names:
            broker.delete_queue(name)
        broker.close()


def test_every_master_of_a_cluster_is_checked_for_eviction(
    redis_cluster: PrivateRedisCluster,
) -> None:
    """An evicting policy on any master deletes the jobs of the queues it serves: refused,
    even when it is not the node the client asks keyless commands (its default node)."""
    broker = RedisBroker.from_url(redis_cluster.url)
    default_port = int(broker.client.get_default_node().port)  # type: ignore[attr-defined]
    other = next(node for node in broker.client.get_primaries()  # type: ignore[attr-defined]
                 if int(node.port) != default_port)
    with redis.Redis(port=int(other.port), socket_timeout=5) as server:
        server.config_set("maxmemory-policy", "allkeys-lru")
        try:
            with pytest.raises(ConfigError, match="allkeys-lru"):
                broker.durability()
        finally:
            server.config_set("maxmemory-policy", "noeviction")
            broker.close()


@pytest.mark.parametrize("backend", HA_BACKENDS)
def test_scripts_are_loaded_again_on_a_master_that_lost_them(
    backend: str, request: pytest.FixtureRequest, queue_name: str
) -> None:
    """A promoted replica has no script cache (scripts replicate as their effects): the
    first call of each script meets NOSCRIPT and loads it there, the caller sees nothing."""
    server = request.getfixturevalue(f"redis_{backend}")
    broker = open_broker(server.url)
    try:
        publish(broker, queue_name, 2)
        ports = ([server.master_port()] if backend == "sentinel"
                 else [node.port for node in server.nodes])
        for port in ports:
            with redis.Redis(port=port, socket_timeout=5) as client:
                client.script_flush()
        publish(broker, queue_name, 3)  # publish + WAIT (replicas=1)
        taken = broker.take(queue_name, max_jobs=10, lock_timeout_s=30)
        assert len(taken) == 5
        broker.settle(queue_name, Settlement(ack=taken))
        assert broker.stats(queue_name).model_dump() == {
            "ready": 0, "locked": 0, "delayed": 0, "dead": 0}
    finally:
        broker.delete_queue(queue_name)
        broker.close()


@pytest.mark.parametrize("backend", HA_BACKENDS)
def test_a_master_with_fewer_replicas_than_publishes_wait_for_is_noted(
    backend: str, request: pytest.FixtureRequest
) -> None:
    """The harnesses have one replica per master: ``replicas=2`` would make every publish
    fail, which the durability notes (logged at connect, shown by ``qcluster stats``) say
    before the first one does."""
    server = request.getfixturevalue(f"redis_{backend}")
    enough, short = open_broker(server.url), open_broker(f"{server.url}?replicas=2")
    try:
        assert not [note for note in enough.durability() if "replica(s) connected" in note]
        notes = [note for note in short.durability() if "replica(s) connected" in note]
    finally:
        enough.close()
        short.close()
    masters = 1 if backend == "sentinel" else server.masters
    assert len(notes) == masters, notes
    assert all("1 replica(s) connected, fewer than replicas=2" in note for note in notes)
