"""The one parse of a broker URL (qcluster/broker/urls.py): every accepted spelling reads
back as written, the masked form never shows a password, and a ``;`` list is split the
same way by every reader (the backend choice, masking, the master's /healthz addresses,
the RabbitMQ option splits and the queue type the configuration adds)."""

from __future__ import annotations

import socket
import string
from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qcluster.broker import backend_module, check_redis_auth
from qcluster.broker.amqp_link import split_url_options
from qcluster.broker.amqp_topology import split_queue_type
from qcluster.broker.redis_client import SOCKET_TIMEOUT_S
from qcluster.broker.urls import (
    MAX_REPLICA_TIMEOUT_MS,
    BrokerUrl,
    mask_url,
    parse_broker_url,
    split_urls,
)
from qcluster.config import load_settings
from qcluster.errors import ConfigError
from qcluster.master.broker_health import broker_addresses

secrets = st.text(alphabet=string.ascii_letters + string.digits + "!$&'()*+,;=-._~@:/?#[]% ",
                  min_size=4, max_size=24).filter(lambda s: s.strip() == s)
users = st.text(alphabet=string.ascii_letters + string.digits + "-._", max_size=10)
names = st.from_regex(r"[a-z][a-z0-9-]{0,15}", fullmatch=True)
ipv6 = st.sampled_from(["::1", "fe80::1", "2001:db8::7"])
hosts = st.one_of(names, st.sampled_from(["127.0.0.1", "10.1.2.3"]), ipv6)
ports = st.integers(1, 65535)


def _netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _userinfo(user: str, password: str | None) -> str:
    if password is None:
        return f"{user}@" if user else ""
    return f"{user}:{quote(password, safe='')}@"


@given(scheme=st.sampled_from(["redis", "rediss"]), user=users,
       password=st.one_of(st.none(), secrets), host=hosts, port=ports, db=st.integers(0, 15))
def test_one_redis_reads_back_as_written(scheme: str, user: str, password: str | None,
                                         host: str, port: int, db: int) -> None:
    url = f"{scheme}://{_userinfo(user, password)}{_netloc(host, port)}/{db}"
    parsed = parse_broker_url(url)
    assert (parsed.kind, parsed.scheme, parsed.text, parsed.parts) == ("redis", scheme, url,
                                                                       (url,))
    assert parsed.hosts == ((host.lower(), port),)
    assert parsed.password == password
    assert parsed.username == (user or None)
    assert backend_module(url) == "qcluster.broker.redis_broker"


@given(kind=st.sampled_from(["redis-sentinel", "redis-cluster"]), user=users,
       password=st.one_of(st.none(), secrets),
       nodes=st.lists(st.tuples(hosts, ports), min_size=1, max_size=4),
       service=names, db=st.integers(0, 15), replicas=st.integers(0, 5),
       timeout_ms=st.integers(1, MAX_REPLICA_TIMEOUT_MS))
def test_sentinel_and_cluster_read_back_as_written(
    kind: str, user: str, password: str | None, nodes: list[tuple[str, int]], service: str,
    db: int, replicas: int, timeout_ms: int,
) -> None:
    sentinel = kind == "redis-sentinel"
    path = f"/{service}/{db}" if sentinel else ""
    url = (f"redis+{kind.removeprefix('redis-')}://{_userinfo(user, password)}"
           f"{','.join(_netloc(h, p) for h, p in nodes)}{path}"
           f"?replicas={replicas}&replica_timeout_ms={timeout_ms}")
    parsed = parse_broker_url(url)
    assert parsed.kind == kind and parsed.hosts == tuple(nodes)
    assert (parsed.service, parsed.db) == ((service, db) if sentinel else ("", 0))
    assert (parsed.replicas, parsed.replica_timeout_ms) == (replicas, timeout_ms)
    assert parsed.password == password
    # The printed form is itself a URL that reads back the same (with no password).
    again = parse_broker_url(parsed.safe())
    assert (again.kind, again.hosts, again.service, again.db) == (
        kind, parsed.hosts, parsed.service, parsed.db)


@given(parts=st.lists(st.tuples(st.sampled_from(["amqp", "amqps", "pyamqp"]), users,
                                st.one_of(st.none(), secrets), hosts, ports),
                      min_size=1, max_size=4))
def test_a_rabbitmq_failover_list_reads_back_entry_by_entry(
    parts: list[tuple[str, str, str | None, str, int]],
) -> None:
    urls = [f"{scheme}://{_userinfo(user, password)}{_netloc(host, port)}/vhost"
            for scheme, user, password, host, port in parts]
    text = " ; ".join(urls)  # spaces around the separator are not part of a URL
    parsed = parse_broker_url(text)
    assert parsed.kind == "rabbitmq" and parsed.parts == tuple(urls)
    assert parsed.hosts == tuple((host.lower(), port) for _, _, _, host, port in parts)
    assert split_urls(text) == urls


@pytest.mark.parametrize(("url", "expected"), [
    (None, BrokerUrl(kind="embedded", text="embedded", parts=("embedded",))),
    ("  ", BrokerUrl(kind="embedded", text="embedded", parts=("embedded",))),
    ("embedded:///var/lib/qc", BrokerUrl(kind="embedded", text="embedded:///var/lib/qc",
                                         parts=("embedded:///var/lib/qc",),
                                         state_dir="/var/lib/qc")),
    ("redis+socket:///run/r.sock", BrokerUrl(kind="redis", text="redis+socket:///run/r.sock",
                                             parts=("redis+socket:///run/r.sock",),
                                             socket_path="/run/r.sock")),
    ("unix:///run/r.sock?db=2", BrokerUrl(kind="redis", text="unix:///run/r.sock?db=2",
                                          parts=("unix:///run/r.sock?db=2",),
                                          socket_path="/run/r.sock")),
])
def test_embedded_and_unix_sockets(url: str | None, expected: BrokerUrl) -> None:
    assert parse_broker_url(url) == expected


@pytest.mark.parametrize(("url", "says"), [
    ("amqp://a//;redis://b", "each entry must be an amqp:// URL"),
    ("redis://h:99999/0", "Port out of range"),
    ("redis://[::1/0", "Invalid IPv6 URL"),
    ("http://h", "unsupported broker URL"),
])
def test_a_bad_url_is_one_line_without_its_password(url: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as refused:
        parse_broker_url(url.replace("//", "//u:s3cret@", 1))
    assert "\n" not in str(refused.value) and "s3cret" not in str(refused.value)


@given(text=st.text(max_size=120))
def test_a_parse_answers_a_url_or_a_one_line_config_error(text: str) -> None:
    try:
        parsed = parse_broker_url(text)
    except ConfigError as refused:
        assert "\n" not in str(refused)
    else:
        assert parsed.parts and all(part.strip() == part for part in parsed.parts)


@given(password=secrets, scheme=st.sampled_from(
    ["redis://", "rediss://", "amqp://", "redis+cluster://", "redis+sentinel://"]))
def test_the_masked_form_never_shows_a_password(password: str, scheme: str) -> None:
    password = f"S3cr3t{password}"  # a mark no part of a URL or a repr spells by chance
    secret = quote(password, safe="")
    path = "/svc" if scheme == "redis+sentinel://" else "/0"
    for url in (f"{scheme}u:{secret}@h:1{path}", f"{scheme}:{secret}@h:1{path}",
                f"redis://h:1/0?password={secret}",
                f"redis+sentinel://h:1/svc?sentinel_password={secret}"):
        parsed = parse_broker_url(url)
        for shown in (parsed.safe(), mask_url(url), repr(parsed)):
            assert "S3cr3t" not in shown


@given(urls=st.lists(st.sampled_from(["amqp://u:p@a:5672/v", "amqp://b", "amqps://c:1/",
                                      "", " ", "amqp://d?heartbeat=5"]),
                     min_size=1, max_size=5).filter(lambda u: any(x.strip() for x in u)))
def test_every_reader_splits_a_list_the_same_way(urls: list[str]) -> None:
    text = ";".join(urls)
    entries = split_urls(text)
    assert entries == [u.strip() for u in urls if u.strip()]
    assert len(split_urls(mask_url(text))) == len(entries)
    assert len(split_urls(split_url_options(text)[0])) == len(entries)
    assert len(split_urls(split_queue_type(text)[0])) == len(entries)
    if entries[0].startswith("amqp"):
        assert len(parse_broker_url(text).parts) == len(entries)
        assert len(broker_addresses(text, Path("."))) == len(entries)
        with_type = load_settings(None, broker_url=text, queue_type="quorum").broker_url
        assert with_type is not None and len(split_urls(with_type)) == len(entries)
        assert all(one.endswith("queue_type=quorum") for one in split_urls(with_type))


def test_the_addresses_of_an_embedded_url_naming_its_directory(tmp_path: Path) -> None:
    from qcluster.broker.embedded import socket_path

    assert broker_addresses(f"embedded://{tmp_path}", Path("elsewhere")) == [
        (socket.AF_UNIX, str(socket_path(tmp_path)))]


def test_a_remote_redis_without_password_is_refused_with_its_masked_url() -> None:
    with pytest.raises(ConfigError, match="no password") as refused:
        check_redis_auth("redis://u@10.1.2.3:6379/0")
    assert "redis://u@10.1.2.3:6379/0" in str(refused.value)
    check_redis_auth("redis://10.1.2.3:6379/0?password=x")
    check_redis_auth("redis+socket:///run/r.sock")


def test_the_replica_wait_stays_under_the_redis_socket_timeout() -> None:
    assert int(SOCKET_TIMEOUT_S * 1000) - 500 == MAX_REPLICA_TIMEOUT_MS


# A password as a user may paste it, not percent-encoded: ";", "#", "/", "?" cut a URL
# short where urllib (or the ";" list) reads them, so none of what follows may print it.
raw_passwords = st.text(alphabet=string.ascii_letters + string.digits + ";#/?@:% ",
                        min_size=1, max_size=24).map(lambda s: f"S3cr3t{s}")
raw_schemes = st.sampled_from(["redis://", "rediss://", "amqp://", "amqps://", "pyamqp://",
                               "redis+sentinel://", "redis+cluster://"])


def _shown_forms(url: str) -> list[str]:
    """What a user can see of ``url``: its masked form, and the parse's printed form and
    repr, or the parse's refusal."""
    try:
        parsed = parse_broker_url(url)
    except ConfigError as refused:
        return [mask_url(url), str(refused)]
    return [mask_url(url), parsed.safe(), repr(parsed)]


@given(password=raw_passwords, scheme=raw_schemes, user=st.sampled_from(["", "u"]))
def test_an_unencoded_password_is_never_shown(password: str, scheme: str, user: str) -> None:
    path = "/svc" if scheme == "redis+sentinel://" else "/0"
    url = f"{scheme}{user}:{password}@10.0.0.5:1{path}"
    for shown in _shown_forms(url):
        assert password not in shown and "S3cr3t" not in shown, shown


@pytest.mark.parametrize("url", [
    "redis://:pa;S3cr3t@10.0.0.5/0",  # a ";" splits only RabbitMQ lists
    "amqp://user:S3cr3t#et@host/vh",  # urllib's port error quoted "S3cr3t"
    "amqp://user:S3cr3t;x@host/vh",
    "amqp://user:S3cr3t/x@host/vh",
    "redis://:S3cr3t?x@h/0",
    "redis+sentinel://:S3cr3t/x@h:26379/svc",
    "redis+sentinel://:x/S3cr3t@h:26379/svc",
    "redis://h/0?password=x#S3cr3t",
])
def test_a_password_cut_short_by_a_separator_is_masked_whole(url: str) -> None:
    for shown in _shown_forms(url):
        assert "S3cr3t" not in shown, shown
