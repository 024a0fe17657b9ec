"""What qcluster needs of redis-py and prometheus_client beyond their documented API. Each
test names the internal it checks: an upgrade that changes one fails loudly here, instead
of silently in a Cluster or Sentinel failover or in the slots' metric files.

The list: every private or undocumented part of a dependency that qcluster uses (kombu,
py-amqp: tests/contract/test_kombu_internals.py; uvicorn's h11 protocol:
tests/unit/test_http_limits.py). The versions checked are pinned in pyproject.toml.

redis-py
- ``RedisCluster.nodes_manager.initialize()`` (broker/redis_durability.py ``server_for``):
  reads the slot map again after a failover, before a WAIT on the new master (no public
  call does that without a command to route).
- ``RedisCluster.nodes_manager.connection_kwargs`` (broker/health.py): the credentials the
  cluster client was made with, for the health check's own short-lived node clients.
- ``SentinelConnectionPool.sentinel_manager`` (its ``sentinels``), ``.service_name``,
  ``.connection_kwargs`` (broker/health.py): the Sentinels, the service and the
  credentials behind a Sentinel client; ``Sentinel.sentinels`` (broker/redis_ha.py, the
  one-line MasterNotFoundError).
- ``redis.crc.key_slot`` (broker/health.py): the hash slot of a queue's key.
- ``RedisCluster.ERRORS_ALLOW_RETRY`` (broker/redis_ha.py ``ShortLivedCluster``): the
  error types a Cluster command is retried on (by exact type); a short-lived caller's
  client leaves TimeoutError out, so a frozen master costs one socket timeout.
- ``Script.sha`` / ``Script.script`` of what ``register_script`` returns
  (broker/redis_durability.py ``publish_replicated``: EVALSHA + WAIT in one pipeline).
- ``ConnectionPool.make_connection()`` / ``.reset()``, its ``_available_connections``
  list and ``_created_connections`` count, a connection's ``pid`` (slot/prefork.py
  ``open_slot_broker``): the master makes the slots' connection before it forks, and
  each slot puts its copy in its own pool, owned by its own pid, to be connected there.
- Replaced by public API: ``ClusterNode.redis_connection`` (now
  ``RedisCluster.get_redis_connection(node)``), the ``Script`` subclass and
  ``redis._parsers.encoders.Encoder`` (now ``redis_ha.NodeScript``, a class of its own
  on EVALSHA / EVAL).

prometheus_client
- ``prometheus_client.values.ValueClass`` replaced by
  ``values.MultiProcessValue(process_identifier=...)`` (metrics.use_slot_identity): a
  slot's metric files are named by its slot number, not its PID, so 100 restarts leave a
  handful of files, not hundreds.
- A histogram child's ``_buckets`` and ``_sum`` (metrics.HistogramTally.write_to): a
  batch's figures added with one ``inc`` per bucket touched instead of an ``observe`` per
  job.
- Replaced by public API: ``MultiProcessCollector._path`` (now the ``path=`` the master
  passes it itself).
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
from importlib.metadata import version
from pathlib import Path

import prometheus_client
import pytest
import redis
import redis.cluster
import redis.crc
import redis.sentinel
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client import multiprocess as prometheus_multiprocess
from prometheus_client import values as prometheus_values

from qcluster.metrics import HistogramTally

#: The ranges these tests passed with; pyproject.toml pins the same bounds.
TESTED = {"redis": ((5, 0), (8, 2)), "prometheus_client": ((0, 20), (0, 27))}


def _major_minor(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def outside_tested(package: str, installed: str) -> str | None:
    """Why ``installed`` is not a version of ``package`` these tests were checked with."""
    low, high = TESTED[package]
    if low <= _major_minor(installed) < high:
        return None
    return (f"{package} {installed} is outside {low} <= version < {high}, the range "
            "tests/contract/test_dependency_internals.py was checked with: run this file, "
            "then widen TESTED here and the pin in pyproject.toml")


@pytest.mark.parametrize("package", sorted(TESTED))
def test_installed_versions_are_the_tested_ones(package: str) -> None:
    reason = outside_tested(package, version(package))
    assert reason is None, reason


@pytest.mark.parametrize(("package", "text"), [
    ("redis", "8.2.0"), ("redis", "9.0.1"), ("redis", "4.6.0"),
    ("prometheus_client", "0.27.0"), ("prometheus_client", "1.0.0"),
    ("prometheus_client", "0.19.0"),
])
def test_a_version_outside_the_range_fails_the_check(package: str, text: str) -> None:
    assert outside_tested(package, text) is not None


def test_the_pins_in_pyproject_are_the_tested_ranges() -> None:
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    for package, (low, high) in TESTED.items():
        pin = f'"{package}>={low[0]}.{low[1]},<{high[0]}.{high[1]}"'
        assert pin in pyproject, f"pyproject.toml does not pin {pin}"


# --- redis-py -----------------------------------------------------------------------------


def _init_assigns(cls: type, *names: str) -> None:
    source = inspect.getsource(cls.__init__)  # type: ignore[misc]
    for name in names:
        assert f"self.{name} =" in source, (
            f"redis-py's {cls.__qualname__} no longer sets {name} (qcluster reads it)")


def test_redis_cluster_nodes_manager_has_what_the_broker_uses() -> None:
    _init_assigns(redis.cluster.RedisCluster, "nodes_manager")
    manager = redis.cluster.NodesManager
    assert callable(getattr(manager, "initialize", None)), (
        "redis.cluster.NodesManager.initialize() is gone (broker/redis_durability.py server_for)")
    _init_assigns(manager, "connection_kwargs")
    for name in ("get_redis_connection", "get_node_from_key", "get_primaries", "get_nodes"):
        assert callable(getattr(redis.cluster.RedisCluster, name, None)), name
    assert list(inspect.signature(redis.cluster.RedisCluster.get_redis_connection)
                .parameters) == ["self", "node"]


def test_redis_cluster_retries_the_error_types_of_its_class_attribute() -> None:
    """ShortLivedCluster overrides the class attribute RedisCluster's command loop reads
    (``type(e) in self.__class__.ERRORS_ALLOW_RETRY``) to retry no TimeoutError."""
    from qcluster.broker.redis_ha import ShortLivedCluster

    allowed = redis.cluster.RedisCluster.ERRORS_ALLOW_RETRY
    assert redis.TimeoutError in allowed and redis.ConnectionError in allowed
    source = inspect.getsource(redis.cluster.RedisCluster._internal_execute_command)
    assert "self.__class__.ERRORS_ALLOW_RETRY" in source, (
        "RedisCluster no longer reads ERRORS_ALLOW_RETRY from its class (redis_ha.py)")
    assert redis.TimeoutError not in ShortLivedCluster.ERRORS_ALLOW_RETRY
    assert redis.ConnectionError in ShortLivedCluster.ERRORS_ALLOW_RETRY


def test_redis_sentinel_pool_has_what_the_health_check_reads() -> None:
    sentinel = redis.sentinel.Sentinel([("127.0.0.1", 1)])
    pool = sentinel.master_for("svc", password="pw").connection_pool
    assert pool.sentinel_manager is sentinel and pool.service_name == "svc"
    assert pool.connection_kwargs["password"] == "pw"
    assert sentinel.sentinels[0].get_connection_kwargs()["port"] == 1


def test_redis_key_slot_is_the_cluster_hash_slot() -> None:
    assert redis.crc.key_slot(b"123456789") == 12739  # the Cluster spec's own example
    assert redis.crc.key_slot(b"{user1000}.following") == redis.crc.key_slot(b"user1000")


def test_a_registered_script_has_its_sha_and_text(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        script = client.register_script("return 1")
        assert script.script == "return 1"
        assert script.sha == client.script_load("return 1")
        script.sha = "0" * 40  # the broker loads it again on a new master
        assert client.evalsha(client.script_load(script.script), 0) == 1
    finally:
        client.close()


def test_a_connection_made_before_a_fork_is_handed_out_by_the_pool_after_it(
        redis_url: str) -> None:
    """What prefork.open_slot_broker does in a slot, in one process: the pool forgets
    what it held (as after a fork), then hands out the connection put in its list first,
    connects it, and keeps it (owned: its pid) when it comes back."""
    import os

    client = redis.Redis.from_url(redis_url)
    try:
        pool = client.connection_pool
        connection = pool.make_connection()
        assert connection._sock is None and connection.pid == os.getpid()
        pool.reset()
        assert (pool._available_connections, pool._created_connections) == ([], 0)
        connection.pid = pool.pid
        pool._available_connections.append(connection)
        pool._created_connections += 1
        assert client.ping()
        assert pool._available_connections == [connection] and connection._sock is not None
        assert pool._created_connections == 1
    finally:
        client.close()


# --- prometheus_client --------------------------------------------------------------------


def test_a_histogram_child_has_buckets_and_sum_that_take_inc() -> None:
    registry = CollectorRegistry()
    histogram = Histogram("qc_contract_seconds", "h", ["queue"], buckets=(0.1, 1.0),
                          registry=registry)
    child = histogram.labels("q")
    tally = HistogramTally((0.1, 1.0))
    tally.add_many([0.05, 0.5, 0.5, 3.0])
    tally.write_to(child)  # through _buckets[i].inc and _sum.inc
    text = generate_latest(registry).decode()
    assert 'qc_contract_seconds_bucket{le="0.1",queue="q"} 1.0' in text
    assert 'qc_contract_seconds_bucket{le="1.0",queue="q"} 3.0' in text
    assert 'qc_contract_seconds_count{queue="q"} 4.0' in text
    assert 'qc_contract_seconds_sum{queue="q"} 4.05' in text


def test_value_class_is_read_at_each_metric_and_takes_a_process_identifier(
    tmp_path: Path
) -> None:
    """In a process of its own: the replacement is process-wide, as in a slot."""
    assert "process_identifier" in inspect.signature(
        prometheus_values.MultiProcessValue).parameters
    assert hasattr(prometheus_values, "ValueClass")
    program = textwrap.dedent("""
        import os, sys
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
        from qcluster import metrics
        metrics.use_slot_identity(7)
        from prometheus_client import CollectorRegistry, Counter
        Counter("qc_contract_total", "c", registry=CollectorRegistry()).inc()
        print(sorted(os.listdir(sys.argv[1])))
    """)
    done = subprocess.run([sys.executable, "-c", program, str(tmp_path)], check=True,
                          capture_output=True, text=True)
    assert done.stdout.strip() == "['counter_slot7.db']", done.stdout + done.stderr


def test_the_multiprocess_collector_takes_its_path_and_merges_files() -> None:
    collector = prometheus_multiprocess.MultiProcessCollector
    assert "path" in inspect.signature(collector.__init__).parameters
    assert list(inspect.signature(collector.merge).parameters) == ["files", "accumulate"]
    assert prometheus_client.multiprocess is prometheus_multiprocess
