"""What every qcluster HTTP server checks, in one place: the ``--listen`` address, whether
it is loopback, the Host header of a loopback server (DNS rebinding), the Bearer token, and
the rules a token must meet before a server starts.

Pure functions and one small ASGI middleware (the request body limit); the manager
(FastAPI), the admin UI and the master's stdlib server all use them.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, NamedTuple

from qcluster.errors import ConfigError

DEFAULT_HOST = "127.0.0.1"
#: Tokens shorter than this are refused at start (a guessable token is no token).
MIN_TOKEN_LENGTH = 16
#: Placeholders and dictionary words seen in examples; refused whatever their length.
WELL_KNOWN_TOKENS = frozenset({
    "change-me", "changeme", "change_me", "changeit", "secret", "token", "password",
    "passw0rd", "admin", "qcluster", "default", "test", "example", "s3cret", "letmein",
    "replace-me", "replaceme", "please-change-me", "your-token-here", "xxxxxxxx",
})
#: Largest request body any qcluster HTTP endpoint reads (a host report of 1,000 queues
#: is ~0.5 MiB).
MAX_BODY_BYTES = 1 << 20


class ListenAddress(NamedTuple):
    host: str
    """Without brackets (``::1``), ready for bind()."""
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)


def is_decimal(text: str) -> bool:
    """ASCII digits only: ``str.isdigit`` also accepts '¹' or '٣', which ``int`` refuses."""
    return text.isascii() and text.isdigit()


def parse_listen(text: str, option: str = "--listen") -> ListenAddress:
    """``HOST:PORT``, ``[IPV6]:PORT``, ``:PORT`` or ``PORT`` (loopback); ConfigError else."""
    value = text.strip()
    if is_decimal(value):
        host, port = DEFAULT_HOST, value
    elif value.startswith("["):
        inside, closed, rest = value[1:].partition("]")
        if not closed or not rest.startswith(":"):
            raise _bad_listen(option, text)
        host, port = inside, rest[1:]
    else:
        host, sep, port = value.rpartition(":")
        if not sep or ":" in host:  # no port, or a bare IPv6 address
            raise _bad_listen(option, text)
        host = host or DEFAULT_HOST
    if not is_decimal(port) or not 0 < int(port) < 65536 or not host:
        raise _bad_listen(option, text)
    return ListenAddress(host, int(port))


def _bad_listen(option: str, text: str) -> ConfigError:
    return ConfigError(f"{option}: expected HOST:PORT, [IPV6]:PORT or PORT (1-65535), "
                       f"got {text!r}")


def is_loopback(host: str) -> bool:
    """The one loopback rule of every qcluster check: ``localhost`` (any case, a trailing
    dot), 127.0.0.0/8 in every spelling the system's resolver accepts (``127.1``,
    ``0x7f.0.0.1``, ``2130706433``), ``::1`` in any form (brackets, IPv4-mapped
    ``::ffff:127.x.y.z``). Anything else, other names included, is not loopback."""
    name = host.strip().lower().removeprefix("[").removesuffix("]")
    if name.removesuffix(".") == "localhost":
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return _shorthand_ipv4_is_loopback(name)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def _shorthand_ipv4_is_loopback(name: str) -> bool:
    """``127.1``, ``0177.0.0.1``, ``0x7f000001``: inet_aton's forms, which a bind() or a
    connect() to that name accept (it also ignores what follows a space: not here)."""
    address = inet_aton_value(name)
    return address is not None and address >> 24 == 127


#: The digits of inet_aton's number bases (a 0x prefix: hexadecimal; a leading 0: octal).
_BASE_DIGITS = {16: frozenset("0123456789abcdef"), 8: frozenset("01234567"),
                10: frozenset("0123456789")}


def inet_aton_value(name: str) -> int | None:
    """The IPv4 address ``name`` spells as inet_aton reads it (1 to 4 dot-separated
    numbers, each decimal, octal or hexadecimal; the last fills the bytes left), as a
    32-bit number; None when inet_aton refuses it. Written out so that this module does
    no I/O; tests/unit/test_loopback_rule.py checks it against the real inet_aton."""
    parts = name.split(".")
    if not 1 <= len(parts) <= 4:
        return None
    numbers = [_inet_number(part) for part in parts]
    if any(number is None for number in numbers):
        return None
    *leading, last = (number for number in numbers if number is not None)
    if any(number > 0xFF for number in leading) or last >= 1 << (8 * (4 - len(leading))):
        return None
    value = last
    for position, number in enumerate(leading):
        value |= number << (8 * (3 - position))
    return value


def _inet_number(part: str) -> int | None:
    if part[:2] == "0x":
        base, digits = 16, part[2:]
    elif len(part) > 1 and part[0] == "0":
        base, digits = 8, part[1:]
    else:
        base, digits = 10, part
    if not digits or not set(digits) <= _BASE_DIGITS[base]:
        return None
    return int(digits, base)


def host_header_is_loopback(value: str | None) -> bool:
    """A Host header naming a loopback host (with or without a port)."""
    if not value:
        return False
    text = value.strip()
    if text.startswith("["):
        host, closed, rest = text[1:].partition("]")
        if not closed or (rest and not (rest.startswith(":") and is_decimal(rest[1:]))):
            return False
    else:
        host, sep, port = text.partition(":")
        if sep and not is_decimal(port):
            return False
    return is_loopback(host)


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer TOKEN`` header; None when absent."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def check_server_security(listen: ListenAddress, token: str | None, *, role: str) -> None:
    """Refuse to start a server that anyone could steer: a public bind without a token, or
    a token that is short or well known. One line each (ConfigError)."""
    if token is not None:
        check_token_strength(token)
    elif not listen.loopback:
        raise ConfigError(
            f"{role}: refusing to listen on {listen} (not loopback) without a token: set "
            "`token` in qcluster.toml or QCLUSTER_TOKEN (16+ random characters, e.g. "
            "`openssl rand -hex 24`), or listen on 127.0.0.1")


def check_token_strength(token: str) -> None:
    if token.strip().lower() in WELL_KNOWN_TOKENS:
        raise ConfigError("the token is a well-known placeholder: set `token` / QCLUSTER_TOKEN "
                          "to 16+ random characters (e.g. `openssl rand -hex 24`)")
    if len(token.strip()) < MIN_TOKEN_LENGTH:
        raise ConfigError(f"the token is shorter than {MIN_TOKEN_LENGTH} characters: set "
                          "`token` / QCLUSTER_TOKEN to 16+ random characters "
                          "(e.g. `openssl rand -hex 24`)")


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class GuardMiddleware:
    """ASGI: a loopback server answers 400 to a foreign Host header (DNS rebinding), and any
    request body above ``max_body_bytes`` gets 413 before the app sees it."""

    def __init__(self, app: ASGIApp, *, loopback: bool,
                 max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.loopback = loopback
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        if self.loopback and not host_header_is_loopback(headers.get("host")):
            await _plain(send, 400, "Invalid host header: this server answers loopback names only")
            return
        declared = headers.get("content-length")
        if declared is not None and (not is_decimal(declared.strip())
                                     or int(declared) > self.max_body_bytes):
            await _plain(send, 413, f"Request body above {self.max_body_bytes} bytes")
            return
        body = await self._read_body(receive)
        if body is None:
            await _plain(send, 413, f"Request body above {self.max_body_bytes} bytes")
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive: Receive) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # disconnected: the app sees an empty body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _plain(send: Send, status: int, text: str) -> None:
    body = text.encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
