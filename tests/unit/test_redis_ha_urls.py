"""Sentinel and Cluster URLs (qcluster/broker/redis_ha.py): what is parsed, what is refused
with one line, and that a password never shows in the URL printed in logs and errors."""

from __future__ import annotations

from urllib.parse import quote

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qcluster.broker import backend_module, check_redis_auth, open_broker
from qcluster.broker.urls import parse_ha_url
from qcluster.errors import BrokerUnavailable, ConfigError
from tests.brokers import free_port


def test_sentinel_url_names_sentinels_service_db_and_options() -> None:
    parsed = parse_ha_url("redis+sentinel://:s3cret@10.0.0.1:26380,10.0.0.2,[::1]:5000"
                          "/mymaster/2?replicas=2&replica_timeout_ms=500&sentinel_password=x")
    assert parsed.kind == "redis-sentinel"
    assert parsed.hosts == (("10.0.0.1", 26380), ("10.0.0.2", 26379), ("::1", 5000))
    assert (parsed.service, parsed.db, parsed.password) == ("mymaster", 2, "s3cret")
    assert (parsed.replicas, parsed.replica_timeout_ms, parsed.sentinel_password) == (
        2, 500, "x")
    assert "s3cret" not in parsed.safe() and "x@" not in parsed.safe()


def test_cluster_url_defaults_to_one_replica_and_port_6379() -> None:
    parsed = parse_ha_url("redis+cluster://user:pw@node1,node2:7001")
    assert parsed.hosts == (("node1", 6379), ("node2", 7001))
    assert (parsed.username, parsed.password, parsed.replicas) == ("user", "pw", 1)
    assert parse_ha_url("redis+cluster://node1:7000?replicas=0").replicas == 0
    assert backend_module("redis+cluster://node1:7000") == "qcluster.broker.redis_broker"
    assert backend_module("redis+sentinel://s:1/m") == "qcluster.broker.redis_broker"


@pytest.mark.parametrize(("url", "says"), [
    ("redis+sentinel://127.0.0.1:26379", "names no service"),
    ("redis+sentinel://127.0.0.1:26379/m/x", "database must be a number"),
    ("redis+sentinel:///m", "names no host"),
    ("redis+sentinel://h:99999/m", "bad port"),
    ("redis+cluster://h:1/3", "only database 0"),
    ("redis+cluster://h:1?sentinel_password=x", "not known"),
    ("redis+cluster://h:1?replicas=one", "whole number"),
    ("redis+sentinel://h:1/m?db=2", "not known"),
    # 0 makes WAIT block forever; above 4500 the 5 s socket timeout gives up first.
    ("redis+cluster://127.0.0.1:1?replica_timeout_ms=0", "1 to 4500"),
    ("redis+cluster://127.0.0.1:1?replica_timeout_ms=10000", "1 to 4500"),
])
def test_bad_urls_are_refused_with_one_line(url: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as refused:
        parse_ha_url(url)
    assert "\n" not in str(refused.value)


def test_a_remote_cluster_or_sentinel_needs_a_password() -> None:
    with pytest.raises(ConfigError, match="no password"):
        check_redis_auth("redis+cluster://127.0.0.1:7000,10.1.2.3:7000")
    with pytest.raises(ConfigError, match="no password"):
        check_redis_auth("redis+sentinel://sentinel.example:26379/m")
    check_redis_auth("redis+cluster://:pw@10.1.2.3:7000")
    check_redis_auth("redis+sentinel://127.0.0.1:26379,[::1]:26380/m")


@given(password=st.text(min_size=1, max_size=30).filter(lambda p: p.strip() == p))
def test_the_printed_url_never_shows_the_password(password: str) -> None:
    for url, printed in (
        ("redis+sentinel://:{}@h1:1,h2:2/svc", "redis+sentinel://:***@h1:1,h2:2/svc/0"),
        ("redis+cluster://u:{}@h1:1,h2:2", "redis+cluster://u:***@h1:1,h2:2"),
    ):
        parsed = parse_ha_url(url.format(quote(password, safe="")))
        assert parsed.password == password
        assert parsed.safe() == printed


def test_a_cluster_down_at_start_is_unavailable_not_a_crash() -> None:
    """RedisCluster connects in its constructor: a slot or producer started while no node
    answers got RedisClusterException out of open_broker. Now the broker opens, and its
    calls raise BrokerUnavailable (a slot pauses and tries again) until a node answers."""
    url = f"redis+cluster://127.0.0.1:{free_port()}?replicas=0"
    broker = open_broker(url)
    try:
        with pytest.raises(BrokerUnavailable):
            broker.stats("q")
        with pytest.raises(BrokerUnavailable):
            broker.publish_many("q", [("a", b"{}")])
    finally:
        broker.close()


def test_no_sentinel_answering_is_unavailable_in_one_short_line() -> None:
    broker = open_broker(f"redis+sentinel://127.0.0.1:{free_port()}/svc")
    try:
        with pytest.raises(BrokerUnavailable, match=r"no Sentinel of 127\.0\.0\.1:") as refused:
            broker.stats("q")
    finally:
        broker.close()
    assert len(str(refused.value)) < 300 and "\n" not in str(refused.value)
