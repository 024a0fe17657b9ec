"""A short-lived caller (``qcluster stats``, ``qcluster enqueue``, a ``Client``) is told in
seconds that its broker cannot be reached, in one line naming the URL: it gives up after
SHORT_LIVED_GIVE_UP_S of retrying (plus one connect or reply timeout for a broker that
accepts and never answers). Before, a refused port took 6-7 s and a frozen broker 10 s
(Redis) or 36 s (RabbitMQ, six connect timeouts). Long-lived processes keep their retries.

No timing is asserted: each call runs with the documented bound as its own limit (a
thread's join, a subprocess's timeout), and the test asserts it ended, and how."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from qcluster import exitcodes
from qcluster.broker import SHORT_LIVED_GIVE_UP_S, open_broker
from qcluster.broker.amqp_link import URL_OPTIONS
from qcluster.broker.kombu_broker import KombuBroker
from qcluster.broker.redis_broker import RedisBroker
from qcluster.broker.redis_client import SOCKET_TIMEOUT_S
from qcluster.client import Client
from qcluster.errors import BrokerUnavailable
from tests.brokers import PrivateRedis, PrivateRedisCluster
from tests.conftest import QCLUSTER, _started, qcluster_env

#: What a refused call may take beyond SHORT_LIVED_GIVE_UP_S: the backoff wait under way
#: when it passes (kombu's is at most 1.2 s by then) and a busy machine.
MARGIN_S = 2.0
#: A call to a port that refuses connections ends within this.
REFUSED_BOUND_S = SHORT_LIVED_GIVE_UP_S + MARGIN_S
#: A call to a broker that accepts and never answers: one connect or reply timeout more.
SILENT_BOUND_S = SHORT_LIVED_GIVE_UP_S + max(SOCKET_TIMEOUT_S, URL_OPTIONS["connect_timeout"]
                                             ) + MARGIN_S
#: A Cluster client's call: also reads the slot map and (a first call) checks every
#: master's durability, a dozen round trips that a busy machine slows. Before, 16 to 32 s.
CLUSTER_SILENT_BOUND_S = SILENT_BOUND_S + 3.0
#: A command also starts Python and imports qcluster first.
COMMAND_BOUND_S = REFUSED_BOUND_S + 2.0

URLS = {"redis": "redis://127.0.0.1:{port}/0", "rabbitmq": "amqp://guest:guest@127.0.0.1:{port}//"}


@pytest.fixture
def refused_port() -> Iterator[int]:
    """A port that refuses connections: bound (so no other test takes it), not listening."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield held.getsockname()[1]


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections (the kernel completes them) and never answers: a
    frozen broker, or one whose host stopped answering after the handshake."""
    with socket.create_server(("127.0.0.1", 0), backlog=16) as listener:
        yield listener.getsockname()[1]


def _ends_within(bound_s: float, call: Callable[[], Any]) -> BaseException | object:
    """What ``call`` raised or returned, asserting it ended within ``bound_s``."""
    outcome: list[BaseException | object] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=bound_s)
    assert not thread.is_alive(), f"still waiting for the broker after {bound_s:g} s"
    return outcome[0]


def _assert_said_unreachable(outcome: BaseException | object, port: int) -> None:
    assert isinstance(outcome, BrokerUnavailable), outcome
    message = str(outcome)
    assert "\n" not in message and f"127.0.0.1:{port}" in message and "unreachable" in message
    assert "guest:guest" not in message  # the password is masked
    assert "is it running" in message, message


CALLS: dict[str, Callable[[Client], Any]] = {
    "stats": lambda client: client.stats("q"),
    "enqueue": lambda client: client.enqueue("q", {"n": 1}),
    "job": lambda client: client.job("0123456789abcdef", queue="q"),
}


@pytest.mark.parametrize("kind", list(URLS))
@pytest.mark.parametrize("call", list(CALLS))
def test_a_client_gives_up_on_a_refused_port_in_seconds(
        kind: str, call: str, refused_port: int) -> None:
    url = URLS[kind].format(port=refused_port)
    outcome = _ends_within(REFUSED_BOUND_S, lambda: CALLS[call](Client(url)))
    _assert_said_unreachable(outcome, refused_port)


@pytest.mark.parametrize("kind", list(URLS))
def test_a_job_lookup_in_no_queue_says_the_broker_is_unreachable(
        kind: str, refused_port: int) -> None:
    """``Client.job(id)`` without a queue, on a RabbitMQ it never used (AMQP cannot list
    queues: nothing to look in), answered ``unknown`` ("no queue holds it") without
    reaching the broker: a stopped broker was taken for a job found nowhere."""
    url = URLS[kind].format(port=refused_port)
    outcome = _ends_within(REFUSED_BOUND_S, lambda: Client(url).job("0123456789abcdef"))
    _assert_said_unreachable(outcome, refused_port)


@pytest.mark.parametrize("kind", list(URLS))
def test_a_client_gives_up_on_a_broker_that_never_answers(kind: str, silent_port: int) -> None:
    """One connect (RabbitMQ) or reply (Redis) timeout, not one at connect and another at
    the first call (Redis, 10 s), nor six (RabbitMQ, 36 s)."""
    url = URLS[kind].format(port=silent_port)
    outcome = _ends_within(SILENT_BOUND_S, lambda: Client(url).stats("q"))
    _assert_said_unreachable(outcome, silent_port)


def test_a_client_gives_up_on_a_redis_that_was_stopped(tmp_path: Path) -> None:
    server = PrivateRedis(tmp_path / "redis", aof=False)
    url = server.start()
    try:
        Client(url).enqueue("q", {"n": 1})
    finally:
        server.stop()
    outcome = _ends_within(REFUSED_BOUND_S, lambda: Client(url).stats("q"))
    _assert_said_unreachable(outcome, server.port)


def test_a_client_reconnects_when_redis_closed_its_connection(redis_url: str) -> None:
    """Giving up early still opens again a pooled connection the server closed (a restart,
    an idle timeout): at least one retry."""
    client = Client(redis_url)
    client.enqueue("q-reconnect", {"n": 1})
    broker = client.broker
    assert isinstance(broker, RedisBroker)
    own_id = broker.client.client_id()
    with redis.Redis.from_url(redis_url) as admin:
        assert admin.client_kill_filter(_id=own_id) == 1
    assert client.stats("q-reconnect")["ready"] >= 1
    client.purge("q-reconnect")
    client.close()


@pytest.mark.parametrize("kind", list(URLS))
def test_qcluster_stats_on_a_refused_port_exits_5_in_one_line(
        kind: str, refused_port: int) -> None:
    url = URLS[kind].format(port=refused_port)
    with tempfile.TemporaryDirectory() as empty:  # no qcluster.toml around
        result = subprocess.run([*QCLUSTER, "stats", "q", "--broker", url], cwd=empty,
                                env=qcluster_env(COLUMNS="300"), capture_output=True,
                                text=True, timeout=COMMAND_BOUND_S)
    assert result.returncode == exitcodes.BROKER_CONNECT, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{refused_port}" in lines[0], lines
    assert "unreachable" in lines[0] and "is it running" in lines[0], lines


def test_long_lived_processes_keep_their_retries(redis_url: str, rabbitmq_url: str) -> None:
    """Slots, masters and the manager open brokers without a give-up time: Redis retries
    a failed connection 5 times with backoff and RabbitMQ connects 5 times more, however
    long that takes, so they ride out a broker's restart."""
    redis_broker = open_broker(redis_url)
    assert isinstance(redis_broker, RedisBroker)
    retry = redis_broker.client.connection_pool.connection_kwargs["retry"]
    assert retry.get_retries() == 5
    redis_broker.close()
    rabbit = open_broker(rabbitmq_url)
    assert isinstance(rabbit, KombuBroker)
    assert (rabbit.link.give_up_s, rabbit.link.max_retries) == (None, 5)
    assert rabbit.reader().link.give_up_s is None
    rabbit.close()
    short = Client(redis_url).broker
    assert isinstance(short, RedisBroker)
    assert 1 <= short.client.connection_pool.connection_kwargs["retry"].get_retries() < 5
    short.close()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRedisCluster]:
    # No failover while a master is frozen: the test is about waiting for a silent one.
    cluster = PrivateRedisCluster(Path(tmp_path_factory.mktemp("redis-cluster")),
                                  node_timeout_ms=60000)
    _started(cluster.start)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.parametrize("connected", [True, False], ids=["connected", "fresh"])
def test_a_client_gives_up_on_a_frozen_cluster_master(
        redis_cluster: PrivateRedisCluster, connected: bool) -> None:
    """A Redis Cluster master that stops answering (SIGSTOP): the Cluster client retried
    the timed-out command with the slot map read again, the publish retried it too, and
    a first call's durability check asked the frozen master twice, 5 s each: 16 to 32 s measured.
    Now one socket timeout. The queue's master is not the first node listed, which a
    client that was never connected asks for the slot map."""
    queue = next(name for name in (f"frozen-{n}" for n in range(100))
                 if redis_cluster.master_of(f"qc:{{{name}}}:ready") is not redis_cluster.nodes[0])
    url = redis_cluster.url + "?replica_timeout_ms=4500"
    client = Client(url)
    client.enqueue(queue, {"n": 0})
    if not connected:
        client.close()
        client = Client(url)
    master = redis_cluster.master_of(f"qc:{{{queue}}}:ready")
    assert master.proc is not None
    os.kill(master.proc.pid, signal.SIGSTOP)
    try:
        outcome = _ends_within(CLUSTER_SILENT_BOUND_S, lambda: client.enqueue(queue, {"n": 1}))
    finally:
        os.kill(master.proc.pid, signal.SIGCONT)
        client.close()
    assert isinstance(outcome, BrokerUnavailable), outcome
    assert "unreachable" in str(outcome) and "\n" not in str(outcome), outcome
