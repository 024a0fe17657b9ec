"""The one place for broker URL knowledge (issue 18): scheme -> backend module, and masking
a URL's password for logs and pages. Also broker-side regressions that need no broker of
the suite's: the embedded broker's probe and state directory, Redis durability after a
late connect, and a slot that keeps its heartbeat while the broker is down."""

from __future__ import annotations

import importlib
import socket
import string
from pathlib import Path
from urllib.parse import quote, urlsplit

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from qcluster.broker import (
    EMBEDDED_MODULE,
    KOMBU_MODULE,
    REDIS_MODULE,
    backend_module,
    mask_url,
    open_broker,
)
from qcluster.broker.urls import split_urls
from qcluster.errors import ConfigError
from tests.unit.recording_channel import RecordingChannel

BACKENDS = [
    (None, EMBEDDED_MODULE), ("embedded", EMBEDDED_MODULE), (" embedded ", EMBEDDED_MODULE),
    ("embedded:///var/lib/qc", EMBEDDED_MODULE),
    ("redis://h:6379/0", REDIS_MODULE), ("rediss://:pw@h/1", REDIS_MODULE),
    ("redis+socket:///run/redis.sock", REDIS_MODULE), ("unix:///run/redis.sock", REDIS_MODULE),
    ("amqp://u:p@h:5672//", KOMBU_MODULE), ("amqps://h//", KOMBU_MODULE),
    ("pyamqp://h//", KOMBU_MODULE), ("amqp://a//;amqp://b//", KOMBU_MODULE),
]


@pytest.mark.parametrize(("url", "module"), BACKENDS)
def test_each_scheme_names_its_backend_module(url: str | None, module: str) -> None:
    assert backend_module(url) == module
    importlib.import_module(module)  # the name is a module that exists


@pytest.mark.parametrize("url", [
    "librabbitmq://h//", "http://h", "REDIS://h", "redis:/h", "h:6379", "", "sqs://k:s@x",
    "user:secret@host://x",
])
def test_an_unsupported_scheme_is_refused_with_one_line_and_no_secret(url: str) -> None:
    if not url:
        assert backend_module(url) == EMBEDDED_MODULE  # unset: the embedded broker
        return
    with pytest.raises(ConfigError) as refused:
        backend_module(url)
    message = str(refused.value)
    assert "\n" not in message and "unsupported broker URL" in message
    assert "secret" not in message and ":s@" not in message
    with pytest.raises(ConfigError):
        open_broker(url)  # the same verdict: one source


@pytest.mark.parametrize(("url", "masked"), [
    ("redis://:s3cret@h:6379/0", "redis://:**@h:6379/0"),
    ("redis://user:s3cret@h/0", "redis://user:**@h/0"),
    ("amqp://u:p@a//;amqp://u:q@b//", "amqp://u:**@a//;amqp://u:**@b//"),
    ("redis://u:p@ss@h/0", "redis://u:**@h/0"),  # an "@" inside the password
    ("redis://h/0?password=s3cret&db=1", "redis://h/0?password=**&db=1"),
    ("redis+sentinel://:p@h:26379/m?sentinel_password=s3&x=1",
     "redis+sentinel://:**@h:26379/m?sentinel_password=**&x=1"),
    ("redis://h:6379/0", "redis://h:6379/0"),
    ("unix:///run/redis.sock", "unix:///run/redis.sock"),
    ("embedded", "embedded"),
    ("redis://u:p@[::1/0", "redis://**"),  # unparsable: the scheme only
])
def test_mask_url(url: str, masked: str) -> None:
    assert mask_url(url) == masked


password_text = st.text(alphabet=string.ascii_letters + string.digits + "!$&'()*+,;=-._~@:",
                        min_size=1, max_size=30)
user_text = st.text(alphabet=string.ascii_letters + string.digits + "-._", max_size=12)
hosts = st.sampled_from(["h", "rabbit-1.example", "127.0.0.1", "[::1]"])


@given(scheme=st.sampled_from(["redis", "rediss", "amqp", "amqps"]), user=user_text,
       password=password_text, host=hosts, port=st.integers(1, 65535))
@example(scheme="redis", user="", password="h", host="h", port=6379)
def test_a_masked_url_keeps_everything_but_the_password(
    scheme: str, user: str, password: str, host: str, port: int
) -> None:
    encoded = quote(password, safe="")  # as a user must write it in a URL
    url = f"{scheme}://{user}:{encoded}@{host}:{port}/0"
    masked = mask_url(url)
    parts, original = urlsplit(masked), urlsplit(url)
    assert parts.password == "**"
    assert (parts.scheme, parts.username or "", parts.hostname, parts.port, parts.path) == (
        original.scheme, original.username or "", original.hostname, original.port,
        original.path)
    assert mask_url(masked) == masked  # idempotent
    assert backend_module(masked) == backend_module(url)


@given(st.text(max_size=200))
@example(text="x://a/;@b")  # not a RabbitMQ list: masked as one URL, its ";" with it
def test_mask_url_never_raises_and_never_shows_a_userinfo_password(text: str) -> None:
    masked = mask_url(text)  # only a RabbitMQ list keeps its ";" entries: check it whole
    for original in split_urls(text):
        try:
            password = urlsplit(original).password
        except ValueError:
            continue
        if password and password != "**":
            assert f":{password}@" not in masked


@given(st.text(max_size=100))
def test_backend_module_answers_a_module_or_a_one_line_config_error(text: str) -> None:
    try:
        module = backend_module(text)
    except ConfigError as refused:
        assert "\n" not in str(refused)
    else:
        assert module in (EMBEDDED_MODULE, REDIS_MODULE, KOMBU_MODULE)


# --- the embedded broker's liveness probe ---------------------------------------------


def test_a_stale_embedded_socket_is_answered_with_one_attempt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A socket file left by a killed embedded server: one connection attempt, not redis-py's
    default 1 + 3 retries with backoff (3.6 s, twice per ensure_server, before a restart).
    Fails on the code before (4 attempts)."""
    import redis.connection

    from qcluster.broker.embedded import _answers

    sock = tmp_path / "redis.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(sock))
    stale.close()  # the file stays, nobody listens
    sock.chmod(0o700)  # private, as the embedded server makes it
    attempts: list[int] = []
    connect = redis.connection.UnixDomainSocketConnection._connect

    def counted(self: redis.connection.UnixDomainSocketConnection) -> socket.socket:
        attempts.append(1)
        return connect(self)

    monkeypatch.setattr(redis.connection.UnixDomainSocketConnection, "_connect", counted)
    assert _answers(sock) is False
    assert len(attempts) == 1


@pytest.mark.parametrize("state_dir", ["/proc/qcluster-unusable", "/dev/null/qcluster"])
def test_an_unusable_embedded_state_dir_is_one_config_line(state_dir: str) -> None:
    """Chaos row B4: FileNotFoundError/NotADirectoryError from mkdir used to
    escape as a traceback (the manager exited 1); now a ConfigError naming the directory."""
    from qcluster.broker.embedded import ensure_server

    with pytest.raises(ConfigError) as refused:
        ensure_server(Path(state_dir))
    message = str(refused.value)
    assert "\n" not in message and state_dir in message and "not usable" in message


# --- Redis durability, checked even when the server was down at connect -----------------


def test_a_redis_down_at_connect_is_checked_once_it_answers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by chaos row F8: a process that connected while Redis was down
    skipped the durability check for good, so an evicting server was used and a missing
    AOF never named. Fails on the code before (the publish succeeded)."""
    import subprocess

    import redis

    from qcluster.broker.embedded import redis_server_binary
    from qcluster.broker.redis_broker import RedisBroker
    from tests.brokers import free_port
    from tests.conftest import wait_until

    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    broker = RedisBroker.from_url(url, retries=0)
    broker.check_durability()  # nobody answers: nothing to check yet
    proc = subprocess.Popen(
        [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir",
         str(tmp_path), "--appendonly", "no", "--save", "", "--maxmemory-policy",
         "allkeys-lru"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    raw = redis.Redis.from_url(url)
    try:
        def answers() -> bool:
            try:
                return bool(raw.ping())
            except redis.ConnectionError:
                return False

        wait_until(answers, timeout_s=60, message="redis-server up")
        for _ in range(2):  # refused, and again while it still evicts
            with pytest.raises(ConfigError, match="maxmemory-policy allkeys-lru"):
                broker.publish("q", "j", b"{}")
        assert raw.zcard("qc:{q}:ready") == 0  # nothing stored by a refused call
        raw.config_set("maxmemory-policy", "noeviction")
        with caplog.at_level("WARNING", logger="qcluster.broker.redis_broker"):
            broker.publish("q", "j", b"{}")
        assert broker.stats("q").ready == 1
        assert [r.getMessage() for r in caplog.records if "no persistence" in r.getMessage()]
    finally:
        raw.close()
        broker.close()
        proc.terminate()
        proc.wait(timeout=10)


# --- a slot waiting for the broker is alive, not hung ------------------------------------


class _DownBroker:
    """Every take fails as with a broker that is down; the n-th failure stops the slot."""

    def __init__(self, runner_box: list[object], failures: int) -> None:
        self.runner_box, self.failures, self.calls = runner_box, failures, 0

    def settle_and_take(self, *args: object, **kwargs: object) -> list[object]:
        from qcluster.errors import BrokerUnavailable

        self.calls += 1
        if self.calls >= self.failures:
            self.runner_box[0].should_stop = True  # type: ignore[attr-defined]
        raise BrokerUnavailable("Redis at redis://h:6379/0 unreachable: connection refused")

    def __getattr__(self, name: str) -> object:
        return lambda *args, **kwargs: None  # leave, close, settle: nothing to do


def test_a_slot_whose_broker_is_down_keeps_sending_heartbeats(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chaos rows F8 and F10 (full profile): a slot looping on broker errors sent the
    master nothing, so after heartbeat_timeout_s the master SIGKILLed it as hung and forked
    another, every 30 s while the broker was down. Fails on the code before (no heartbeat)."""
    from qcluster import App, Job
    from qcluster.messages import Heartbeat
    from qcluster.slot import runtime

    app = App()

    @app.queue("q")
    def handle(jobs: list[Job]) -> None:
        pass

    monkeypatch.setattr(runtime, "BROKER_ERROR_PAUSE_S", 0.0)
    monkeypatch.setattr(runtime, "HEARTBEAT_INTERVAL_S", 0.0)  # every pass may send one
    box: list[object] = []
    channel = RecordingChannel()
    runner = runtime.SlotRunner(app, "q", _DownBroker(box, 3),  # type: ignore[arg-type]
                                channel=channel, slot_no=1)  # type: ignore[arg-type]
    box.append(runner)
    assert runner._loop() == 0
    beats = [m for m in channel.sent if isinstance(m, Heartbeat)]
    assert len(beats) == 3 and all(beat.idle and beat.queue == "q" for beat in beats)


def test_a_kombu_broker_reconnecting_lets_the_caller_show_it_is_alive() -> None:
    """Chaos row F9 on RabbitMQ: a call that reconnects through a dead link
    spends up to a minute in connect attempts, and the slot inside it sent nothing, so the
    master killed it as hung every 30 s. Broker.on_wait is now called between attempts
    (the slot sends a heartbeat). Fails on the code before (never called)."""
    from qcluster.broker.kombu_broker import KombuBroker
    from qcluster.errors import BrokerUnavailable
    from tests.brokers import free_port

    broker = KombuBroker(f"amqp://guest:guest@127.0.0.1:{free_port()}//?heartbeat=0",
                         max_retries=2)
    calls: list[int] = []
    broker.on_wait = lambda: calls.append(1)
    with pytest.raises(BrokerUnavailable):
        broker.publish("q", "j", b"{}")  # nobody listens: refused at once, 3 attempts
    broker.close()
    assert len(calls) >= 2


def test_a_slot_sends_a_heartbeat_while_its_broker_waits() -> None:
    from qcluster import App, Job
    from qcluster.messages import Heartbeat
    from qcluster.slot.runtime import SlotRunner

    app = App()

    @app.queue("q")
    def handle(jobs: list[Job]) -> None:
        pass

    channel = RecordingChannel()
    broker = _DownBroker([], 99)
    SlotRunner(app, "q", broker, channel=channel, slot_no=1)  # type: ignore[arg-type]
    assert callable(broker.on_wait)
    broker.on_wait()
    assert [type(m) for m in channel.sent] == [Heartbeat]


# --- a Redis on another machine needs a password (issue 16, S4) ---------------------------


@pytest.mark.parametrize("url", [
    "redis://192.0.2.2:6379/0", "rediss://redis.example:6380/0", "redis://user@10.1.2.3/0",
    "redis://redis:6379/0", "redis://[2001:db8::1]:6379/0", "redis://10.0.0.1/0?password=",
])
def test_a_redis_on_another_machine_without_a_password_is_refused(url: str) -> None:
    from qcluster.broker import check_redis_auth

    with pytest.raises(ConfigError) as refused:
        check_redis_auth(url)
    message = str(refused.value)
    assert "\n" not in message and "no password" in message and "redis://:PASSWORD@" in message
    with pytest.raises(ConfigError):
        open_broker(url)  # refused before any connection attempt


@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:6379/0", "redis://localhost/0", "redis://[::1]:6379/0",
    "redis://127.3.4.5/1", "redis://:s3cret@192.0.2.2:6379/0", "rediss://u:s3cret@h/0",
    "redis://192.0.2.2/0?password=s3cret", "unix:///run/redis.sock",
    "redis+socket:///run/redis.sock",
])
def test_loopback_sockets_and_passwords_pass(url: str) -> None:
    from qcluster.broker import check_redis_auth

    check_redis_auth(url)


def test_the_shipped_deploy_files_give_redis_a_password() -> None:
    """The compose file and the systemd example put the Redis password in the broker URL;
    Kubernetes takes the whole URL from a Secret (nothing shipped carries a password)."""
    import tomllib

    import yaml

    from qcluster.broker import check_redis_auth
    from tests.conftest import ROOT

    deploy = ROOT / "deploy"
    compose = yaml.safe_load((deploy / "compose" / "compose.yaml").read_text())
    url = compose["x-qcluster"]["environment"]["QCLUSTER_BROKER_URL"]
    assert url.startswith("redis://:${QCLUSTER_REDIS_PASSWORD:?"), url
    check_redis_auth(url.replace("${QCLUSTER_REDIS_PASSWORD:?", "x").replace("}", "", 1))
    assert "--requirepass" in compose["services"]["redis"]["command"]
    env = (deploy / "systemd" / "qcluster.env.example").read_text()
    line = next(x for x in env.splitlines() if x.startswith("QCLUSTER_BROKER_URL="))
    check_redis_auth(line.partition("=")[2])
    for path in (deploy / "k8s").rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") in ("Deployment", "DaemonSet"):
                container = doc["spec"]["template"]["spec"]["containers"][0]
                env_vars = {e["name"]: e for e in container["env"]}
                ref = env_vars["QCLUSTER_BROKER_URL"]["valueFrom"]["secretKeyRef"]
                assert ref == {"name": "qcluster-broker", "key": "url"}, path
            if doc and doc.get("kind") == "ConfigMap":
                settings = tomllib.loads(doc["data"]["qcluster.toml"])
                assert "broker_url" not in settings, path  # the Secret's, not here
