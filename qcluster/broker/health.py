"""Per-node broker health: which servers the broker is made of, whether each answers, and
which one serves each queue (issue 17 item 5; shown by the manager and the admin page).

- Redis Cluster: one ``CLUSTER NODES`` from the first node that answers (every master and
  replica, their flags and hash slots), then a ``PING`` to each node (down: no answer in
  ``NODE_TIMEOUT_S``, or flagged ``fail`` by the cluster); a queue's node is the
  master whose slot ranges hold the slot of its hash tag ``{NAME}`` (computed here with
  redis-py's ``key_slot``, no round trip).
- Redis Sentinel: each Sentinel's view of the master and its replicas (``SENTINEL MASTER``
  and ``SENTINEL REPLICAS`` from the first that answers), then a ``PING`` to each server and
  each Sentinel. Every queue is on the master.
- One Redis, the embedded broker, RabbitMQ: one row, the broker's own ``ping``.

The pings use their own short-lived connections with a short timeout and no retry: a node
that does not answer costs at most ``NODE_TIMEOUT_S``, not the broker client's retries.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis
from pydantic import BaseModel, ConfigDict, Field
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

from qcluster.broker.base import Broker
from qcluster.errors import BrokerError

#: Connect and reply timeout of one node's PING (a dead loopback node refuses at once).
NODE_TIMEOUT_S = 1.0
#: An error shown on a node's row is cut to this many characters.
ERROR_CHARS = 200


class NodeHealth(BaseModel):
    """One server of the broker."""

    model_config = ConfigDict(frozen=True)

    address: str
    """``host:port`` (a Redis node or Sentinel), or the broker's URL without secrets."""
    role: str
    """``master``, ``replica``, ``sentinel`` or ``server`` (one Redis, embedded, RabbitMQ)."""
    ok: bool
    error: str | None = None
    """Why it did not answer (or what the cluster says of it: ``fail``), None when ok."""
    slots: str = ""
    """A Cluster master's hash slots, as ``0-5460,6000``; empty otherwise."""
    master: str | None = None
    """A replica's master address (as the cluster or the Sentinels know it)."""


class BrokerHealth(BaseModel):
    """The broker's nodes and which one serves each queue, as read at ``checked_at``."""

    model_config = ConfigDict(frozen=True)

    kind: str
    """``redis``, ``redis-cluster``, ``redis-sentinel``, ``embedded``, ``rabbitmq`` (else the
    broker class's name)."""
    checked_at: float
    nodes: list[NodeHealth] = Field(default_factory=list)
    queue_nodes: dict[str, str] = Field(default_factory=dict)
    """Queue -> address of the node holding it (one-server brokers: that server)."""
    error: str | None = None
    """Set when the topology could not be read at all (then ``nodes`` may be empty)."""


def read_health(broker: Broker, queues: Iterable[str],
                clock: Callable[[], float] = time.time,
                known_problem: str | None = None) -> BrokerHealth:
    """Read the health of ``broker``'s nodes and the node of each of ``queues``.

    ``known_problem``: why the caller's last broker read failed (None: it succeeded). A
    one-server broker is then shown down with it, without a ping (whose retries would cost
    seconds more while the server is away)."""
    names = sorted(set(queues))
    kind = broker.kind()
    client = broker.redis_client()
    if kind == "redis-cluster" and client is not None:
        return _cluster_health(client, names, clock())
    pool = _sentinel_pool(client) if kind == "redis-sentinel" else None
    if pool is not None:
        return _sentinel_health(pool, names, clock())
    return _single_health(broker, kind, names, clock(), known_problem)


# --- one server --------------------------------------------------------------------------


def _single_health(broker: Broker, kind: str, queues: list[str], now: float,
                   known_problem: str | None) -> BrokerHealth:
    address = broker.safe_url or type(broker).__name__
    try:
        if known_problem is not None:
            raise BrokerError(known_problem)
        broker.ping()
        node = NodeHealth(address=address, role="server", ok=True)
    except BrokerError as exc:
        node = NodeHealth(address=address, role="server", ok=False, error=_short(exc))
    return BrokerHealth(kind=kind, checked_at=now, nodes=[node],
                        queue_nodes=dict.fromkeys(queues, address))


# --- Redis Cluster ------------------------------------------------------------------------


def _cluster_health(cluster: Any, queues: list[str], now: float) -> BrokerHealth:
    try:
        known = [f"{node.host}:{node.port}" for node in cluster.get_nodes()]
        credentials = _credentials(cluster.nodes_manager.connection_kwargs)
    except (redis.RedisError, BrokerError) as exc:
        return BrokerHealth(kind="redis-cluster", checked_at=now, error=_short(exc))
    topology, error = _first_answer(known, credentials, "CLUSTER NODES")
    if topology is None:
        return BrokerHealth(kind="redis-cluster", checked_at=now, error=error,
                            nodes=[NodeHealth(address=a, role="node", ok=False, error=error)
                                   for a in known])
    ids = {info["node_id"]: address for address, info in topology.items()}
    nodes = [_cluster_node(address, info, ids, credentials)
             for address, info in sorted(topology.items(), key=_masters_first)]
    ranges = {address: _slot_ranges(info) for address, info in topology.items()
              if "master" in info["flags"] and info["slots"]}
    return BrokerHealth(kind="redis-cluster", checked_at=now, nodes=nodes,
                        queue_nodes=queue_nodes(queues, ranges))


def queue_nodes(queues: Sequence[str],
                ranges: dict[str, list[tuple[int, int]]]) -> dict[str, str]:
    """Queue -> the address whose slot ranges hold the queue's hash slot (the slot of
    ``{NAME}``, as every key of the queue); a slot no node holds maps to nothing."""
    found = {}
    for queue in queues:
        slot = key_slot(f"{{{queue}}}".encode())
        owner = next((address for address, spans in ranges.items()
                      if any(start <= slot <= end for start, end in spans)), None)
        if owner is not None:
            found[queue] = owner
    return found


def _cluster_node(address: str, info: dict[str, Any], ids: dict[str, str],
                  credentials: dict[str, Any]) -> NodeHealth:
    flags = set(str(info["flags"]).split(","))
    role = "master" if "master" in flags else "replica" if "slave" in flags else "node"
    error = _ping(address, credentials)
    if error is None and "fail" in flags:  # agreed by the masters; "fail?" is one node's doubt
        error = "the cluster marks it failed (it answers us, not its peers)"
    return NodeHealth(
        address=address, role=role, ok=error is None, error=error,
        slots=",".join(f"{s}-{e}" if s != e else str(s) for s, e in _slot_ranges(info)),
        master=ids.get(str(info["master_id"])) if role == "replica" else None,
    )


def _slot_ranges(info: dict[str, Any]) -> list[tuple[int, int]]:
    spans = []
    for span in info.get("slots", []):
        start, end = (int(span[0]), int(span[-1]))
        spans.append((start, end))
    return sorted(spans)


def _masters_first(item: tuple[str, dict[str, Any]]) -> tuple[int, int, str]:
    address, info = item
    spans = _slot_ranges(info)
    return ("master" not in info["flags"], spans[0][0] if spans else 1 << 20, address)


# --- Redis Sentinel -----------------------------------------------------------------------


def _sentinel_pool(client: Any) -> Any:
    """The Sentinel master pool of a redis-py client (None: not one; a stand-in)."""
    pool = getattr(client, "connection_pool", None)
    return pool if hasattr(pool, "sentinel_manager") else None


def _sentinel_health(pool: Any, queues: list[str], now: float) -> BrokerHealth:
    service = pool.service_name
    credentials = _credentials(pool.connection_kwargs)
    sentinels = []
    master: dict[str, Any] | None = None
    replicas: list[dict[str, Any]] = []
    for known in pool.sentinel_manager.sentinels:
        kwargs = known.get_connection_kwargs()
        address = f"{kwargs['host']}:{kwargs['port']}"
        try:  # a client of our own: a short timeout and no retry
            with _node_client(address, _credentials(kwargs)) as client:
                if master is None:
                    master = client.sentinel_master(service)
                    replicas = client.sentinel_slaves(service)
                else:
                    client.ping()
            sentinels.append(NodeHealth(address=address, role="sentinel", ok=True))
        except (redis.RedisError, OSError, ValueError) as exc:
            sentinels.append(NodeHealth(address=address, role="sentinel", ok=False,
                                        error=_short(exc)))
    if master is None:
        return BrokerHealth(kind="redis-sentinel", checked_at=now, nodes=sentinels,
                            error=f"no Sentinel answered for the master of {service!r}")
    master_address = f"{master['ip']}:{master['port']}"
    servers = [_sentinel_server(master_address, "master", master, credentials, None)]
    servers += [_sentinel_server(f"{r['ip']}:{r['port']}", "replica", r, credentials,
                                 master_address) for r in replicas]
    return BrokerHealth(kind="redis-sentinel", checked_at=now, nodes=servers + sentinels,
                        queue_nodes=dict.fromkeys(queues, master_address))


def _sentinel_server(address: str, role: str, seen: dict[str, Any],
                     credentials: dict[str, Any], master: str | None) -> NodeHealth:
    error = _ping(address, credentials)
    if error is None and (seen.get("is_sdown") or seen.get("is_odown")):
        error = "the Sentinels see it down"
    return NodeHealth(address=address, role=role, ok=error is None, error=error, master=master)


# --- helpers ------------------------------------------------------------------------------


def _credentials(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {"username": kwargs.get("username"), "password": kwargs.get("password")}


def _node_client(address: str, credentials: dict[str, Any]) -> redis.Redis:
    host, _, port = address.rpartition(":")
    return redis.Redis(host=host.strip("[]"), port=int(port), socket_timeout=NODE_TIMEOUT_S,
                       socket_connect_timeout=NODE_TIMEOUT_S, retry=Retry(NoBackoff(), 0),
                       **credentials)


def _ping(address: str, credentials: dict[str, Any]) -> str | None:
    """None when the node answers PING, else why not (one line)."""
    try:
        with _node_client(address, credentials) as client:
            client.ping()
    except (redis.RedisError, OSError, ValueError) as exc:
        return _short(exc)
    return None


def _first_answer(addresses: list[str], credentials: dict[str, Any],
                  command: str) -> tuple[Any, str | None]:
    """The reply of the first of ``addresses`` that answers ``command``, or the last error."""
    error = "no node known"
    for address in addresses:
        try:
            with _node_client(address, credentials) as client:
                return client.execute_command(command), None
        except (redis.RedisError, OSError, ValueError) as exc:
            error = f"{address}: {_short(exc)}"
    return None, error


def _short(error: BaseException) -> str:
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return lines[0][:ERROR_CHARS]


__all__ = ["BrokerHealth", "NodeHealth", "queue_nodes", "read_health"]
