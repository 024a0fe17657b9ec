"""One loopback rule (qcluster.security.is_loopback) for every check, and the master's
routes behind the token whenever it is bound off loopback."""

from __future__ import annotations

import http.client
import ipaddress
import socket
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qcluster.master.http import serve
from qcluster.master.snapshot import SupervisorSnapshot
from qcluster.security import (
    ListenAddress,
    host_header_is_loopback,
    inet_aton_value,
    is_loopback,
    parse_listen,
)

TOKEN = "a-token-that-is-long-enough-0123456789"


def _spellings(address: int) -> list[str]:
    """What inet_aton (and so bind and connect) accepts for one IPv4 address."""
    a, b, c, d = address.to_bytes(4, "big")
    return [f"{a}.{b}.{c}.{d}", f"{a}.{address & 0xFFFFFF}", f"{a}.{b}.{address & 0xFFFF}",
            str(address), hex(address), f"0{address:o}", f"{a:#x}.{b}.{c}.{d}",
            f"0{a:o}.{b}.{c}.{d}", f"::ffff:{a}.{b}.{c}.{d}", f"[::ffff:{a}.{b}.{c}.{d}]"]


def _system_inet_aton(text: str) -> int | None:
    try:
        return int.from_bytes(socket.inet_aton(text), "big")
    except OSError:
        return None


#: Characters inet_aton's spellings are made of, and a few it must refuse.
INET_TEXT = st.text(alphabet="0123456789abcdefx.X_+- ", max_size=24)


@given(st.one_of(INET_TEXT, st.integers(0, 2**32 - 1).map(hex),
                 st.integers(0, 2**32 - 1).map(lambda n: f"0{n:o}")))
def test_the_written_out_inet_aton_reads_what_the_system_reads(text: str) -> None:
    """security.inet_aton_value (pure: the module does no I/O) against the real one, on
    every text the loopback rule may meet (it only passes names of these characters)."""
    if set(text) <= set("0123456789abcdefx."):
        assert inet_aton_value(text) == _system_inet_aton(text), text


@given(st.one_of(st.integers(127 << 24, (128 << 24) - 1), st.integers(0, 2**32 - 1)))
def test_every_spelling_of_an_ipv4_address_gets_one_answer(address: int) -> None:
    """Fails on the code before: 127.1, 2130706433, 0x7f000001 were not loopback (a
    master on --listen 127.1:P required a token, then never checked it)."""
    expected = address >> 24 == 127
    for spelling in _spellings(address):
        if not spelling.startswith(("::", "[")):  # (the system's own reading of it)
            assert socket.inet_aton(spelling) == address.to_bytes(4, "big")
        assert is_loopback(spelling) is expected, spelling


@given(st.sampled_from(["localhost", "localhost."]), st.data())
def test_localhost_in_any_case_is_loopback(name: str, data: st.DataObject) -> None:
    upper = data.draw(st.lists(st.booleans(), min_size=len(name), max_size=len(name)))
    spelled = "".join(ch.upper() if up else ch for ch, up in zip(name, upper, strict=True))
    assert is_loopback(spelled) and is_loopback(f" {spelled} ")
    assert host_header_is_loopback(f"{spelled}:7301")


@given(st.ip_addresses(v=6))
def test_ipv6_loopback_is_only_one_address(address: ipaddress.IPv6Address) -> None:
    mapped = address.ipv4_mapped
    expected = address == ipaddress.IPv6Address(1) or (mapped is not None
                                                       and mapped.is_loopback)
    assert is_loopback(str(address)) is expected
    assert is_loopback(address.exploded) is expected
    assert is_loopback(f"[{address}]") is expected


@pytest.mark.parametrize("host", ["127.0.0.1 evil.example", "localhost.evil.example",
                                  "a.localhost", "0", "0x7f.0.0.1.evil", "127.0.0.1.",
                                  "1.127.0.0", "abc", ""])
def test_names_and_garbage_are_not_loopback(host: str) -> None:
    assert not is_loopback(host)


def test_a_shorthand_loopback_listen_answers_its_own_host_header() -> None:
    assert parse_listen("127.1:7301").loopback
    server = serve(ListenAddress("127.1", 0), SupervisorSnapshot, "h")
    try:
        port = server.server_address[1]
        assert _get(port, "/api/v1/host", host=f"127.1:{port}")[0] == 200
        assert _get(port, "/api/v1/host", host="evil.example")[0] == 400
    finally:
        server.shutdown()


@pytest.fixture
def public_master() -> Iterator[int]:
    """The master's endpoint bound to every address (off loopback), with its token."""
    server = serve(ListenAddress("0.0.0.0", 0), SupervisorSnapshot, "h", token=TOKEN)
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()


@pytest.mark.parametrize("path", ["/metrics", "/api/v1/host", "/api/v1/slots"])
def test_off_loopback_every_read_route_needs_the_token(public_master: int, path: str) -> None:
    """Fails on the code before: bound off loopback, these answered anyone."""
    assert _get(public_master, path)[0] == 401
    assert _get(public_master, path, authorization="Bearer not-the-token-at-all-xx")[0] == 401
    assert _get(public_master, path, authorization=f"Basic {TOKEN}")[0] == 401
    assert _get(public_master, path, authorization=f"Bearer {TOKEN}")[0] == 200


def test_off_loopback_healthz_stays_open_for_liveness_probes(public_master: int) -> None:
    assert _get(public_master, "/healthz") == (200, b'{"status": "ok", "host": "h"}')


def _get(port: int, path: str, host: str = "127.0.0.1",
         authorization: str | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {"Host": host} | ({"Authorization": authorization} if authorization else {})
    conn.request("GET", path, headers=headers)
    response = conn.getresponse()
    body = response.read()
    conn.close()
    return response.status, body
