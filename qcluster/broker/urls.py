"""One reading of a broker URL: every form the product accepts, parsed once into a
:class:`BrokerUrl` that the backends, the master's health check, the configuration and the
command line all use. Pure: no I/O, no client library.

Accepted forms:

- unset, ``embedded`` or ``embedded:///STATE/DIR``: the embedded Redis;
- ``redis://`` and ``rediss://`` (TLS): one Redis server (port 6379 when left out);
- ``redis+socket:///PATH`` and ``unix:///PATH``: one Redis on a unix socket;
- ``redis+sentinel://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB][?OPTIONS]``: the
  hosts are Sentinels (port 26379 when left out); the password is the master's;
- ``redis+cluster://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...][/0][?OPTIONS]``: any nodes of a
  Redis Cluster (port 6379 when left out); the client discovers the rest;
- ``amqp://``, ``amqps://``, ``pyamqp://``: RabbitMQ; several joined with ``;`` fail over.

Sentinel and Cluster OPTIONS: ``replicas=N`` (a publish returns once N replicas hold the
jobs, by ``WAIT``; default 1, ``0`` turns it off), ``replica_timeout_ms=MS`` (how long a
publish waits for them, default 2000), ``sentinel_password=...`` (Sentinel only).

A bad URL is refused with a :class:`~qcluster.errors.ConfigError` of one line that never
echoes a password.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import SplitResult, parse_qsl, unquote, unquote_plus, urlsplit, urlunsplit

from qcluster.errors import ConfigError

EMBEDDED = "embedded"
EMBEDDED_PREFIX = "embedded://"
#: One Redis over TCP.
REDIS_TCP_SCHEMES = ("redis://", "rediss://")
#: One Redis on a unix socket (``redis+socket://`` is read as redis-py's ``unix://``).
REDIS_SOCKET_SCHEMES = ("redis+socket://", "unix://")
SENTINEL_SCHEME = "redis+sentinel://"
CLUSTER_SCHEME = "redis+cluster://"
#: A master found through Sentinel, a Redis Cluster (qcluster/broker/redis_ha.py).
REDIS_HA_SCHEMES = (SENTINEL_SCHEME, CLUSTER_SCHEME)
REDIS_SCHEMES = REDIS_TCP_SCHEMES + REDIS_SOCKET_SCHEMES + REDIS_HA_SCHEMES
#: py-amqp only: the backend reads frames through its own transport (amqp_readahead) and
#: sends heartbeats from a thread, which kombu's librabbitmq transport does not allow.
AMQP_SCHEMES = ("amqp://", "amqps://", "pyamqp://")
#: Joins the URLs of a RabbitMQ failover list.
SEPARATOR = ";"

DEFAULT_PORTS = {"redis": 6379, "rediss": 6379, "amqp": 5672, "pyamqp": 5672, "amqps": 5671}
SENTINEL_PORT = 26379
CLUSTER_PORT = 6379
#: A publish waits for this many replicas by default: without it, a failover can drop
#: jobs the master acknowledged but had not yet sent to a replica.
DEFAULT_REPLICAS = 1
DEFAULT_REPLICA_TIMEOUT_MS = 2000
#: WAIT must answer before the Redis client's socket timeout (redis_client.SOCKET_TIMEOUT_S,
#: 5 s; a unit test holds the two together), with room for the round trip.
MAX_REPLICA_TIMEOUT_MS = 4500
_HA_OPTIONS = ("replicas", "replica_timeout_ms", "sentinel_password")

#: Query parameters that carry a secret (redis-py reads ``?password=``).
SECRET_QUERY_KEYS = frozenset({"password", "passwd", "pass", "token", "sentinel_password"})
MASK = "**"

Kind = Literal["embedded", "redis", "redis-sentinel", "redis-cluster", "rabbitmq"]
Address = tuple[str, int]


@dataclass(frozen=True)
class BrokerUrl:
    """A parsed broker URL. ``kind`` is also the name health pages show for the broker."""

    kind: Kind
    text: str = field(repr=False)
    """The URL as given (stripped; ``embedded`` when unset). It may carry passwords."""
    parts: tuple[str, ...] = field(default=(), repr=False)
    """Each URL of a ``;``-joined RabbitMQ failover list (one for the other kinds)."""
    hosts: tuple[Address, ...] = ()
    """Where it listens over TCP, in the order given (Sentinel: the Sentinels)."""
    socket_path: str | None = None
    """A unix socket's path (``redis+socket://``, ``unix://``)."""
    state_dir: str | None = None
    """The embedded broker's directory when the URL names one (``embedded:///DIR``)."""
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    service: str = ""
    """The Sentinel service naming the master."""
    db: int = 0
    sentinel_password: str | None = field(default=None, repr=False)
    replicas: int = DEFAULT_REPLICAS
    replica_timeout_ms: int = DEFAULT_REPLICA_TIMEOUT_MS

    @property
    def scheme(self) -> str:
        """The first URL's scheme as written (``embedded`` for the embedded broker)."""
        return self.parts[0].partition("://")[0] if "://" in self.parts[0] else EMBEDDED

    @property
    def is_redis_ha(self) -> bool:
        return self.kind in ("redis-sentinel", "redis-cluster")

    def safe(self) -> str:
        """The URL for logs, pages and errors: every password masked. Sentinel and Cluster
        URLs are shown normalised (ports, service and database spelled out)."""
        if not self.is_redis_ha:
            return mask_url(self.text)
        user = f"{self.username or ''}:***@" if self.password else ""
        hosts = ",".join(f"{host_text(host)}:{port}" for host, port in self.hosts)
        path = f"/{self.service}/{self.db}" if self.kind == "redis-sentinel" else ""
        return f"{self.scheme}://{user}{hosts}{path}"


# --- the ;-separated list and masking ---------------------------------------------------


def split_urls(url: str) -> list[str]:
    """The URLs of a ``;``-joined list, each stripped; an empty entry (a ``;`` at the end,
    two in a row) names nothing and is left out. Every reader of a list splits it here."""
    return [one for one in (piece.strip() for piece in url.split(SEPARATOR)) if one]


def join_urls(urls: list[str]) -> str:
    return SEPARATOR.join(urls)


def mask_url(url: str) -> str:
    """``url`` for logs and pages: each password (in the user info or a ``?password=``
    query; of every URL of a RabbitMQ ``;`` list) replaced by ``**``. Never raises: what
    cannot be parsed is shown as its scheme only, and a user info that a ``/``, ``?``,
    ``#`` or ``;`` written unencoded in a password cuts short is masked whole."""
    text = url.strip()
    entries = split_urls(text)
    if not entries or not entries[0].startswith(AMQP_SCHEMES):
        # Only RabbitMQ URLs form a list: in any other a ";" belongs to the URL.
        return _mask_one(text)
    if not all(_SCHEME.match(one) for one in entries):  # a ";" inside a password
        return _mask_past_userinfo(join_urls(entries))
    return join_urls([_mask_one(one) for one in entries])


#: A URL's scheme and its "://".
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def _mask_one(url: str) -> str:
    scheme = _SCHEME.match(url)
    if not scheme:  # no URL to read a user info from; an "@" may still end a password
        return _mask_past_userinfo(url) if "@" in url else url
    try:
        parts = urlsplit(url)
        rest = url[scheme.end():]
        authority, after = _authority(rest)
        if authority and "@" in after:  # a "/", "?" or "#" in the password ended it early
            return _mask_past_userinfo(url)
        if "@" not in authority and not url.startswith(REDIS_HA_SCHEMES):
            parts.port  # noqa: B018 -- raises if a cut-short password sits in the port
        netloc = parts.netloc
        userinfo, at, host = netloc.rpartition("@")
        if at and ":" in userinfo:
            user = userinfo.partition(":")[0]
            netloc = f"{user}:{MASK}@{host}"
        query = _mask_query(parts.query)
        if netloc == parts.netloc and query == parts.query:
            return url  # nothing secret: exactly as given
        # A "#" in a ?password= value starts the fragment: it goes with the value.
        fragment = MASK if parts.fragment and query != parts.query else parts.fragment
        return urlunsplit(parts._replace(netloc=netloc, query=query, fragment=fragment))
    except ValueError:  # e.g. an unbalanced "[" in the host, a port that is no number
        return f"{scheme.group()}{MASK}"


def _authority(rest: str) -> tuple[str, str]:
    """``rest`` (what follows ``://``) cut where its authority ends: at the first ``/``,
    ``?`` or ``#``."""
    end = min((rest.find(c) for c in "/?#" if c in rest), default=len(rest))
    return rest[:end], rest[end:]


def _mask_past_userinfo(url: str) -> str:
    """``url`` with everything between its ``://`` and its last ``@`` masked: where the
    user info ends cannot be told, so all that may hold a password goes."""
    scheme = _SCHEME.match(url)
    _, at, tail = url.rpartition("@")
    shown = scheme.group() if scheme else ""
    if not at:
        return f"{shown}{MASK}"
    path, has_query, query = tail.partition("?")
    return f"{shown}{MASK}@{path}{has_query}{_mask_query(query)}"


def _mask_query(query: str) -> str:
    if not query:
        return query
    return "&".join(f"{piece.partition('=')[0]}={MASK}" if _is_secret(piece) else piece
                    for piece in query.split("&"))


def _is_secret(query_piece: str) -> bool:
    return unquote_plus(query_piece.partition("=")[0]).strip().lower() in SECRET_QUERY_KEYS


def host_text(host: str) -> str:
    """``host`` as written in a URL (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host else host


# --- parsing ------------------------------------------------------------------------------


def kind_of(url: str | None) -> Kind:
    """The kind of broker ``url`` names (the first of a ``;`` list), without parsing the
    rest of it.

    Raises:
        ConfigError: the scheme is not supported (one line, naming the supported ones).
    """
    first = next(iter(split_urls(url or EMBEDDED)), "")
    if first == EMBEDDED or first.startswith(EMBEDDED_PREFIX):
        return "embedded"
    if first.startswith(SENTINEL_SCHEME):
        return "redis-sentinel"
    if first.startswith(CLUSTER_SCHEME):
        return "redis-cluster"
    if first.startswith(REDIS_SCHEMES):
        return "redis"
    if first.startswith(AMQP_SCHEMES):
        return "rabbitmq"
    scheme, has_scheme, _ = first.partition("://")
    shown = (f"{scheme[:40]!r}://..." if has_scheme and scheme.isprintable()
             and not set(scheme) & set(":@/") else "without a scheme")  # never a password
    raise ConfigError(
        f"unsupported broker URL {shown}: use redis://, rediss://, redis+socket://, "
        "redis+sentinel://, redis+cluster://, amqp:// (RabbitMQ) or leave it unset for the "
        "embedded broker"
    )


def parse_broker_url(url: str | None) -> BrokerUrl:
    """Parse a broker URL (None or empty: the embedded broker).

    Raises:
        ConfigError: one line saying what is wrong (never echoing a password).
    """
    text = (url or EMBEDDED).strip() or EMBEDDED
    kind = kind_of(text)
    if kind == "redis-sentinel" or kind == "redis-cluster":
        return parse_ha_url(text)
    if kind == "embedded":
        state_dir = text.removeprefix(EMBEDDED_PREFIX) if text != EMBEDDED else ""
        return BrokerUrl(kind=kind, text=text, parts=(text,), state_dir=state_dir or None)
    parts = tuple(split_urls(text)) if kind == "rabbitmq" else (text,)
    hosts: list[Address] = []
    socket_path = username = password = None
    for one in parts:
        if not one.startswith(AMQP_SCHEMES if kind == "rabbitmq" else REDIS_SCHEMES):
            raise ConfigError(f"broker URL list {mask_url(text)[:200]!r}: each entry must be "
                              "an amqp:// URL (only RabbitMQ URLs fail over with ';')")
        split, port = _split(one)
        if split.scheme in ("redis+socket", "unix"):
            socket_path = split.path
        elif split.hostname:
            hosts.append((split.hostname, port or DEFAULT_PORTS.get(split.scheme, 0)))
        username = username or (unquote(split.username) if split.username else None)
        password = password or (unquote(split.password) if split.password else None)
        password = password or _query_password(split.query)
    return BrokerUrl(kind=kind, text=text, parts=parts, hosts=tuple(hosts),
                     socket_path=socket_path, username=username, password=password)


def _split(url: str) -> tuple[SplitResult, int | None]:
    """``url`` split, and its port.

    Raises:
        ConfigError: an unbalanced ``[``, a bad port. Never with urllib's own words: they
            quote the netloc, where a password cut short by an unencoded ``#``, ``/`` or
            ``?`` shows as the port.
    """
    try:
        split = urlsplit(url)
    except ValueError:
        raise ConfigError(f"broker URL {mask_url(url)[:200]}: Invalid IPv6 URL (a host "
                          "in [ ] that is not a closed IPv6 address)") from None
    try:
        return split, split.port
    except ValueError:
        port_text = split.netloc.rpartition("@")[2].rpartition(":")[2]
        why = ("Port out of range 0-65535" if port_text.isascii() and port_text.isdigit()
               else "the port is not a number (percent-encode a '#', '/', '?' or ';' "
               "in a password)")
        raise ConfigError(f"broker URL {mask_url(url)[:200]}: {why}") from None


def _query_password(query: str) -> str | None:
    """A ``?password=`` (redis-py reads it as the password)."""
    return next((value for key, value in parse_qsl(query, keep_blank_values=True)
                 if key.strip().lower() == "password" and value), None)


def parse_ha_url(url: str) -> BrokerUrl:
    """Parse a Sentinel or Cluster URL.

    Raises:
        ConfigError: one line saying what is wrong (never echoing a password).
    """
    url = url.strip()
    sentinel = url.startswith(SENTINEL_SCHEME)
    if not sentinel and not url.startswith(CLUSTER_SCHEME):
        raise ConfigError("not a redis+sentinel:// or redis+cluster:// URL")
    scheme = SENTINEL_SCHEME if sentinel else CLUSTER_SCHEME
    rest = url.removeprefix(scheme)
    head = rest.rpartition("@")[0]
    if ("/" in head or "?" in head) and "sentinel_password=" not in head:
        # An unencoded "/" or "?" in the password would be read as the path or options.
        raise ConfigError(f"{scheme} URL {_mask_past_userinfo(url)[:200]}: percent-encode "
                          "a '/' or '?' in its password")
    netloc, _, tail = rest.partition("/")
    path, _, query = tail.partition("?")
    if "?" in netloc:  # redis+cluster://host:port?replicas=0 has no path
        netloc, _, query = netloc.partition("?")
    userinfo, has_user, hostlist = netloc.rpartition("@")
    username = password = None
    if has_user:
        user, _, secret = userinfo.partition(":")
        username, password = unquote(user) or None, unquote(secret) or None
    default_port = SENTINEL_PORT if sentinel else CLUSTER_PORT
    hosts = tuple(_host_port(item, default_port, scheme)
                  for item in hostlist.split(",") if item)
    if not hosts:
        raise ConfigError(f"{scheme} URL names no host: give HOST:PORT[,HOST:PORT...]")
    options = _ha_options(query, scheme)
    segments = [unquote(part) for part in path.split("/") if part]
    if sentinel:
        if not segments:
            raise ConfigError(f"{scheme} URL names no service: "
                              f"{scheme}HOST:PORT[,HOST:PORT...]/SERVICE[/DB]")
        service, db = segments[0], _db(segments[1:], scheme)
    else:
        service, db = "", _db(segments, scheme)
        if db:
            raise ConfigError(f"{scheme} has only database 0 (a cluster has no others)")
    return BrokerUrl(kind="redis-sentinel" if sentinel else "redis-cluster", text=url,
                     parts=(url,), hosts=hosts, service=service, db=db, username=username,
                     password=password, **options)


def _host_port(item: str, default_port: int, scheme: str) -> Address:
    item = item.strip()
    if item.startswith("["):  # [::1]:26379
        host, _, port_text = item[1:].partition("]")
        port_text = port_text.removeprefix(":")
    else:
        host, _, port_text = item.partition(":")
    if not host:
        raise ConfigError(f"{scheme} URL has an empty host in its host list")
    if not port_text:
        return host, default_port
    if not (port_text.isascii() and port_text.isdigit()) or not 0 < int(port_text) < 65536:
        raise ConfigError(f"{scheme} URL has a bad port {port_text[:10]!r} "
                          f"for host {host[:60]!r}")
    return host, int(port_text)


def _db(segments: list[str], scheme: str) -> int:
    if not segments:
        return 0
    text = segments[0]
    if len(segments) > 1 or not (text.isascii() and text.isdigit()):
        raise ConfigError(f"{scheme} URL path: the database must be a number, "
                          f"got {'/'.join(segments)[:40]!r}")
    return int(text)


def _ha_options(query: str, scheme: str) -> dict[str, Any]:
    sentinel = scheme == SENTINEL_SCHEME
    options: dict[str, Any] = {}
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key not in _HA_OPTIONS or (key == "sentinel_password" and not sentinel):
            known = ", ".join(o for o in _HA_OPTIONS if sentinel or "sentinel" not in o)
            raise ConfigError(f"{scheme} URL option {key[:40]!r} is not known "
                              f"(known: {known})")
        if key == "sentinel_password":
            options[key] = value or None
            continue
        if not (value.isascii() and value.isdigit()):
            raise ConfigError(f"{scheme} URL option {key}={value[:20]!r}: "
                              "a whole number is needed")
        options[key] = int(value)
        if key == "replica_timeout_ms" and not 1 <= options[key] <= MAX_REPLICA_TIMEOUT_MS:
            # 0 is "wait forever" to Redis; above the socket timeout the client gives up first.
            raise ConfigError(f"{scheme} URL option replica_timeout_ms={value}: 1 to "
                              f"{MAX_REPLICA_TIMEOUT_MS} (a publish's socket times out at "
                              f"{(MAX_REPLICA_TIMEOUT_MS + 500) / 1000:g} s)")
    return options


__all__ = [
    "AMQP_SCHEMES", "CLUSTER_SCHEME", "EMBEDDED", "EMBEDDED_PREFIX", "REDIS_HA_SCHEMES",
    "REDIS_SCHEMES", "SENTINEL_SCHEME", "BrokerUrl", "Kind", "host_text", "join_urls",
    "kind_of", "mask_url", "parse_broker_url", "parse_ha_url", "split_urls",
]
