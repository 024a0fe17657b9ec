"""A process that opens ``redis+cluster://`` while one master is down serves the queues of
the other shards (issue 17). Its connect-time durability check used to read CONFIG from
every master first, so one dead node made every queue fail for this process until the
client was made again (H7 measured 24 s, past the replica's election)."""

from __future__ import annotations

from pathlib import Path

import pytest

from qcluster.broker import open_broker
from qcluster.client import Client
from qcluster.errors import BrokerUnavailable
from tests.brokers import PrivateRedisCluster


def _on_other_shards(cluster: PrivateRedisCluster) -> tuple[str, str]:
    """Two queue names whose keys live on different masters."""
    first = "q0"
    port = cluster.master_of(f"qc:{{{first}}}:ready").port
    other = next(name for name in (f"q{i}" for i in range(1, 200))
                 if cluster.master_of(f"qc:{{{name}}}:ready").port != port)
    return first, other


def test_a_client_opened_while_a_master_is_down_serves_the_other_shards(tmp_path: Path) -> None:
    # No failover within the test: the dead master's shard stays down.
    cluster = PrivateRedisCluster(tmp_path / "cluster", node_timeout_ms=120_000)
    cluster.start()
    try:
        down_queue, live_queue = _on_other_shards(cluster)
        cluster.master_of(f"qc:{{{down_queue}}}:ready").kill()
        with Client(cluster.url) as client:
            client.enqueue(live_queue, {"n": 1})
        broker = open_broker(cluster.url)
        try:
            assert broker.stats(live_queue).ready == 1
            with pytest.raises(BrokerUnavailable):
                broker.stats(down_queue)
            assert any("does not answer" in note for note in broker.durability())
        finally:
            broker.close()
    finally:
        cluster.stop()
