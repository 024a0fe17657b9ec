"""Per-node broker health on the manager (issue 17 item 5), against real brokers started by
the tests: a private Redis Cluster (3 masters, one replica each), a private Sentinel set and
one private Redis. What the operator reads: each node's address, role, whether it answers,
a Cluster master's hash slots, and which node serves each queue (``/api/v1/cluster``'s
``broker`` section). A SIGKILLed Cluster master shows as down, then its replica as the new
master of the queue."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st
from redis.crc import key_slot

from qcluster.broker import open_broker
from qcluster.broker.base import Broker
from qcluster.broker.health import queue_nodes, read_health
from qcluster.broker.redis_broker import RedisBroker
from qcluster.manager.api.app import create_app
from qcluster.manager.service import ManagerService
from tests.brokers import BrokerUnavailable, PrivateRedisCluster, PrivateRedisSentinel
from tests.conftest import wait_until
from tests.unit.test_manager_state import make_policy, report, state

#: Queue names whose hash slots fall on all three masters of a 3-master cluster.
QUEUES = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]


def _started(server: PrivateRedisCluster | PrivateRedisSentinel) -> None:
    try:
        server.start()
    except BrokerUnavailable as error:
        pytest.fail(str(error), pytrace=False)


def _service(broker: Broker) -> ManagerService:
    """A manager whose one host declares QUEUES, the broker checked once (as at start)."""
    service = ManagerService(state(), broker, "s3cret")
    _report(service)
    service.check_broker()
    return service


def _report(service: ManagerService) -> None:
    """The host reports (again): its queues stay declared while the test waits."""
    service.receive(report("h1", {}, queues={q: make_policy() for q in QUEUES}))


def _api_broker(service: ManagerService) -> dict[str, Any]:
    client = TestClient(create_app(service), base_url="http://127.0.0.1")  # no lifespan: no loop
    response = client.get("/api/v1/cluster")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()["broker"]
    return body


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[PrivateRedisCluster]:
    server = PrivateRedisCluster(tmp_path / "cluster",
                                 node_timeout_ms=5000)  # no spurious failover under load
    _started(server)
    try:
        yield server
    finally:
        server.stop()


def test_cluster_nodes_and_the_node_of_each_queue_then_a_killed_master_and_its_replica(
        cluster: PrivateRedisCluster) -> None:
    broker = open_broker(cluster.url)
    try:
        service = _service(broker)
        view = _api_broker(service)
        assert view["kind"] == "redis-cluster" and view["error"] is None
        roles = sorted(n["role"] for n in view["nodes"])
        assert roles == ["master"] * 3 + ["replica"] * 3
        assert all(n["ok"] for n in view["nodes"]), view["nodes"]
        masters = {n["address"]: n for n in view["nodes"] if n["role"] == "master"}
        assert {n["master"] for n in view["nodes"] if n["role"] == "replica"} == set(masters)
        for queue in QUEUES:  # the node a user would find by CLUSTER KEYSLOT / SLOTS
            served_by = cluster.master_of(f"qc:{{{queue}}}:ready")
            assert view["queue_nodes"][queue] == f"127.0.0.1:{served_by.port}", queue

        victim_queue = "alpha"
        old = cluster.master_of(f"qc:{{{victim_queue}}}:ready")
        old_address = f"127.0.0.1:{old.port}"
        old.kill()
        _report(service)
        service.round()  # alpha's stats fail: the round reads the nodes again
        assert service.broker_problem is not None
        view = _api_broker(service)
        down = next(n for n in view["nodes"] if n["address"] == old_address)
        assert not down["ok"] and down["error"], down

        def replica_took_over() -> bool:
            _report(service)
            service.round()  # again each round while reads fail, and once after
            health = service.broker_nodes()
            return health is not None and health.queue_nodes.get(victim_queue) not in (
                None, old_address)

        wait_until(replica_took_over, interval_s=0.5, message="the replica elected master")
        view = _api_broker(service)
        new_address = view["queue_nodes"][victim_queue]
        new = next(n for n in view["nodes"] if n["address"] == new_address)
        assert new["role"] == "master" and new["ok"], new
        assert new_address == f"127.0.0.1:{cluster.master_of(f'qc:{{{victim_queue}}}:ready').port}"
        old_row = next(n for n in view["nodes"] if n["address"] == old_address)
        assert not old_row["ok"], old_row
    finally:
        broker.close()


def test_sentinel_shows_the_master_its_replica_and_the_sentinels(tmp_path: Path) -> None:
    sentinel = PrivateRedisSentinel(tmp_path / "sentinel", down_after_ms=10000)
    _started(sentinel)
    broker = open_broker(sentinel.url)
    try:
        view = _api_broker(_service(broker))
        assert view["kind"] == "redis-sentinel" and view["error"] is None
        by_role = {role: [n for n in view["nodes"] if n["role"] == role]
                   for role in ("master", "replica", "sentinel")}
        master = f"127.0.0.1:{sentinel.master().port}"
        assert [n["address"] for n in by_role["master"]] == [master]
        assert [n["master"] for n in by_role["replica"]] == [master]
        assert len(by_role["sentinel"]) == 3
        assert all(n["ok"] for n in view["nodes"]), view["nodes"]
        assert view["queue_nodes"] == dict.fromkeys(QUEUES, master)
    finally:
        broker.close()
        sentinel.stop()


def test_one_redis_is_one_row(redis_url: str) -> None:
    broker = open_broker(redis_url)
    try:
        view = _api_broker(_service(broker))
        assert view["kind"] == "redis"
        [node] = view["nodes"]
        assert node["ok"] and node["role"] == "server"
        assert "@" not in node["address"] or "***" in node["address"]  # no password shown
        assert set(view["queue_nodes"]) == set(QUEUES)
    finally:
        broker.close()


def test_a_broker_that_does_not_answer_is_one_row_with_the_error(tmp_path: Path) -> None:
    from tests.brokers import free_port

    broker = RedisBroker.from_url(f"redis://127.0.0.1:{free_port()}/0", retries=0)
    try:
        health = read_health(broker, ["alpha"])
        [node] = health.nodes
        assert not node.ok and node.error
    finally:
        broker.close()


@given(st.lists(st.from_regex(r"[a-z][a-z0-9_.-]{0,20}", fullmatch=True), max_size=20),
       st.lists(st.integers(1, 16383), max_size=6, unique=True))
def test_each_queue_maps_to_the_range_holding_its_hash_slot(
        queues: list[str], cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), 16384]
    ranges = {f"10.0.0.{i}:7000": [(start, end - 1)]
              for i, (start, end) in enumerate(itertools.pairwise(bounds))
              if start < end}
    found = queue_nodes(queues, ranges)
    assert set(found) == set(queues)  # full coverage: every queue has a node
    for queue, address in found.items():
        [(start, end)] = ranges[address]
        assert start <= key_slot(f"qc:{{{queue}}}:ready".encode()) <= end


def test_one_server_down_then_back_follows_the_rounds() -> None:
    """A one-server broker that stops answering shows down at the next round with the
    round's own error, and ok again at the round after it answers."""
    from tests.unit.test_manager_service import FakeBroker

    fake = FakeBroker()
    service = _service(cast(Broker, fake))
    health = service.broker_nodes()
    assert health is not None and [n.ok for n in health.nodes] == [True]
    fake.down = "Redis at redis://10.0.0.9:6379/0 unreachable: connection refused"
    service.round()
    health = service.broker_nodes()
    assert health is not None and not health.nodes[0].ok
    assert health.nodes[0].error is not None and "connection refused" in health.nodes[0].error
    fake.down = None
    service.round()
    health = service.broker_nodes()
    assert health is not None and health.nodes[0].ok


def test_embedded_and_rabbitmq_are_one_row_each(embedded_url: str, rabbitmq_url: str) -> None:
    for url, kind in ((embedded_url, "embedded"), (rabbitmq_url, "rabbitmq")):
        broker = open_broker(url)
        try:
            health = read_health(broker, ["alpha"])
            assert health.kind == kind
            [node] = health.nodes
            assert node.ok and node.role == "server", node
            assert health.queue_nodes == {"alpha": node.address}
            assert "guest:guest" not in node.address  # the URL's password is masked
        finally:
            broker.close()
