"""Issue 15, defect 1: the checks every qcluster HTTP server shares, as pure functions:
the ``--listen`` address (every form, a one-line error for a bad one), every loopback form,
the Host header of a loopback server, Bearer-token parsing, and the refusals at start (a
public bind without a token, a well-known or short token)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qcluster.errors import ConfigError
from qcluster.security import (
    ListenAddress,
    bearer_token,
    check_server_security,
    host_header_is_loopback,
    is_loopback,
    parse_listen,
)

TOKEN = "9f2c4e6a8b0d1f3e5a7c9b1d"


# --- the listen address ----------------------------------------------------------


@pytest.mark.parametrize(("text", "host", "port"), [
    ("127.0.0.1:7300", "127.0.0.1", 7300),
    ("7300", "127.0.0.1", 7300),
    (":7300", "127.0.0.1", 7300),
    ("[::1]:7300", "::1", 7300),
    ("0.0.0.0:80", "0.0.0.0", 80),
    ("localhost:1", "localhost", 1),
])
def test_listen_forms(text: str, host: str, port: int) -> None:
    assert parse_listen(text) == ListenAddress(host, port)


@pytest.mark.parametrize("text", ["127.0.0.1", "127.0.0.1:", "::1:7300", "[::1]", "[::1]7300",
                                  "host:port", "127.0.0.1:0", "127.0.0.1:65536", "", ":",
                                  "1.2.3.4:-1", "[::1:7300"])
def test_bad_listen_is_one_clear_line(text: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_listen(text)
    assert "--listen" in str(refused.value) and "\n" not in str(refused.value)


@given(st.text(max_size=40))
def test_any_listen_text_parses_or_is_refused_clearly(text: str) -> None:
    try:
        address = parse_listen(text)
    except ConfigError:
        return
    assert 0 < address.port < 65536 and address.host


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1.2.3", "127.255.255.254", "::1", "[::1]",
                                  "localhost", "LOCALHOST", "::ffff:127.0.0.1"])
def test_every_loopback_form_is_loopback(host: str) -> None:
    assert is_loopback(host)
    assert parse_listen(f"[{host.strip('[]')}]:1" if ":" in host else f"{host}:1").loopback


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.1", "192.168.1.1", "evil.example",
                                  "localhost.evil.example", "128.0.0.1", ""])
def test_other_hosts_are_not_loopback(host: str) -> None:
    assert not is_loopback(host)


@pytest.mark.parametrize(("header", "ok"), [
    ("127.0.0.1:7300", True), ("localhost", True), ("[::1]:7300", True), ("[::1]", True),
    ("127.0.0.5", True), ("evil.example", False), ("evil.example:7300", False),
    ("127.0.0.1.evil.example", False), ("[::1]evil", False), ("localhost:abc", False),
    ("", False), (None, False),
])
def test_host_header_check(header: str | None, ok: bool) -> None:
    assert host_header_is_loopback(header) is ok


@pytest.mark.parametrize(("header", "token"), [
    (f"Bearer {TOKEN}", TOKEN), (f"bearer  {TOKEN} ", TOKEN), ("Basic abc", None),
    ("Bearer", None), ("Bearer ", None), ("", None), (None, None), (TOKEN, None),
])
def test_bearer_token_parsing(header: str | None, token: str | None) -> None:
    assert bearer_token(header) == token


# --- refusals at start -----------------------------------------------------------


def test_public_bind_without_a_token_is_refused() -> None:
    with pytest.raises(ConfigError, match="without a token"):
        check_server_security(parse_listen("0.0.0.0:7300"), None, role="manager")
    check_server_security(parse_listen("7300"), None, role="manager")  # loopback: allowed
    check_server_security(parse_listen("0.0.0.0:7300"), TOKEN, role="manager")


@pytest.mark.parametrize("token", ["change-me", "CHANGE-ME", "changeme", "secret", "token",
                                   "password", "short-token", "", "               x"])
def test_well_known_or_short_tokens_are_refused(token: str) -> None:
    for listen in ("127.0.0.1:7300", "0.0.0.0:7300"):
        with pytest.raises(ConfigError) as refused:
            check_server_security(parse_listen(listen), token, role="manager")
        assert "\n" not in str(refused.value)


# --- digits that str.isdigit accepts and int refuses (found by hypothesis under load) --


@pytest.mark.parametrize("text", ["¹", "7300¹", "127.0.0.1:¹", "[::1]:٣٠٠", "٣٠٠"])
def test_unicode_digits_are_a_bad_listen_not_a_traceback(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_listen(text)


def test_unicode_digits_in_a_host_port_are_not_loopback() -> None:
    assert not host_header_is_loopback("127.0.0.1:¹")
    assert not host_header_is_loopback("[::1]:¹")


def test_unicode_digits_in_master_slots_are_one_clear_line() -> None:
    from qcluster.cli_support import UsageError
    from qcluster.master.cli import parse_slots

    with pytest.raises(UsageError):
        parse_slots("resize=¹")


def test_a_content_length_of_unicode_digits_is_refused_not_a_500() -> None:
    import asyncio

    from qcluster.security import GuardMiddleware

    async def app(scope: object, receive: object, send: object) -> None:
        raise AssertionError("the app must not see this request")

    sent: list[dict[str, object]] = []

    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/api/v1/reports",
             "headers": [(b"host", b"127.0.0.1"), (b"content-length", "¹".encode("latin-1"))]}
    asyncio.run(GuardMiddleware(app, loopback=True)(scope, receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 413
