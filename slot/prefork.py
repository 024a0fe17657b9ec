"""What the master makes before it forks slots, so that each slot shares it instead of
making its own copy.

A forked slot shares the master's memory copy-on-write: what it makes after the fork is
its own (Private_Dirty), and so is every shared page it writes, if only a reference
count. What every slot would make the same way is therefore made once, here, in the
master (and in a reload template) before the first fork: the slot's modules, the broker
backend and prometheus_client imported, the slots' metric definitions and value class
made.
docs/benchmarks.md (slot memory) says where a slot's memory goes.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qcluster.broker import Broker
    from qcluster.broker.redis_broker import RedisBroker

#: What a slot imports after the fork unless its master did: its loop (and the modules it
#: imports), what its memory check imports, what the Redis broker imports to read its Lua
#: scripts. A master imports most of them anyway; a reload template imports only the app.
SLOT_MODULES = ("qcluster.slot.runtime", "qcluster.procfs", "setproctitle",
                "importlib.resources.readers")


_slot_broker: tuple[int, str, RedisBroker, Any] | None = None
"""(the pid that made it, its URL, the broker, a connection of its pool): a single Redis
broker's client and the connection its slots use, made by :func:`prepare_slots` and
never connected there; each slot forked from that process connects its own copy
(:func:`open_slot_broker`)."""


def prepare_slots(broker_url: str | None, metrics_on: bool) -> None:
    """Import and make in this process (a master or a template, before it forks) what
    every slot would otherwise import or make after the fork."""
    from qcluster.broker import backend_module

    for module in (backend_module(broker_url), *SLOT_MODULES):
        importlib.import_module(module)
    _make_slot_broker(broker_url)
    if metrics_on:
        from qcluster import metrics

        importlib.import_module("prometheus_client")
        importlib.import_module("prometheus_client.multiprocess")
        # Labelled metrics make no value (and no file) until a slot picks its labels: the
        # definitions and the value class are only made, never used, in the master.
        metrics.slot_metrics()
        metrics.slot_value_class()


def clear_type_cache() -> None:
    """Before a pass of forks: empty the interpreter's type attribute cache, so that the
    slots' lookups fill it without writing to the master's memory.

    Each entry of the cache holds a reference to the attribute name it caches: filling
    an entry drops the name the entry held. In a slot, that name was one the master's
    loop looked up last, and dropping it writes its reference count, copying the page
    it sits on for that one write; the slot's lookups fill some hundreds of entries.
    Emptied here, the entries hold ``None`` (one page, written anyway): 0.1 MiB less
    Private_Dirty in a no-op slot. Once per pass, not before each fork: the master's
    own lookups between two forks refill it, and emptying it again would write those
    names in the master, each page then left to the slot forked before (0.1 MiB more).
    Python 3.12 writes no reference count of an interned name: only 3.11 needs it."""
    if sys.version_info < (3, 12):
        sys._clear_type_cache()


def _make_slot_broker(broker_url: str | None) -> None:
    """Make the slots' Redis client (its connection pool, options, parser class, Lua
    scripts registered) and a connection of its pool, without connecting: a slot made
    its own after the fork, 1.0 MiB of its private memory (the objects, and the shared
    pages their making touched: redis-py copies its retry policy, makes an event
    dispatcher and a 64 KiB read buffer for each connection).
    Only a single Redis: a Sentinel or a Cluster client connects as it is made, the
    embedded Redis is held by whoever opens it, RabbitMQ is another client. A URL the
    slot's own open would refuse (a remote Redis without a password, options redis-py
    refuses) is left to it, which says why."""
    global _slot_broker
    from qcluster.broker import check_redis_auth, parse_broker_url

    _slot_broker = None
    if broker_url is None:
        return
    try:
        parsed = parse_broker_url(broker_url)
        if parsed.kind != "redis":
            return
        check_redis_auth(parsed)
        from qcluster.broker.redis_broker import RedisBroker

        broker = RedisBroker.from_url(parsed)
        connection = broker.client.connection_pool.make_connection()  # (no connect)
    except Exception:  # (never an error here: each slot's own open says what fails)
        return
    _slot_broker = (os.getpid(), broker_url, broker, connection)


def open_slot_broker(broker_url: str | None, *, state_dir: Path) -> Broker:
    """A forked slot's broker: the client its master (or template) made before the fork,
    connected now, in the slot, with the same check of the server as
    :func:`qcluster.broker.open_broker`; else (no such client, another URL, or not a
    forked process) the broker ``open_broker`` opens. The made client is handed out
    once in a forked process (a second call opens a new broker), never in the one that
    made it (it stays unconnected for the next forks)."""
    global _slot_broker
    from qcluster.broker import open_broker

    made = _slot_broker
    if made is None or made[0] == os.getpid() or made[1] != broker_url:
        return open_broker(broker_url, state_dir=state_dir)
    _slot_broker = None
    _, _, broker, connection = made
    # What the pool does at its first use in a new process (it drops what it held in
    # the master), then the connection made there becomes this process's own: the pool
    # hands it out first and connects it then, here.
    pool = broker.client.connection_pool
    pool.reset()
    connection.pid = pool.pid
    pool._available_connections.append(connection)
    pool._created_connections += 1
    broker.renew_identity()  # its own take record, not its siblings'
    broker.check_durability()  # an evicting server is refused here, as by open_broker
    return broker


def warm_redis(broker_url: str | None, state_dir: Path) -> None:
    """A reload template's stand-in for the broker check its master made at start: open
    a single Redis broker once and close it, so that what redis-py makes on a first
    connection (and keeps) is made here, shared by the template's slots, instead of in
    each (about 1 MiB of a slot's private memory). Quiet, and never an error: each slot
    opens its own broker and says what fails. Other brokers are not opened here (an
    embedded Redis is held by whoever opens it; a RabbitMQ or a Cluster connects at once)."""
    from qcluster.broker import open_broker
    from qcluster.broker.urls import kind_of

    if broker_url is None or kind_of(broker_url) != "redis":
        return
    notes = logging.getLogger("qcluster.broker.redis_broker")  # its master said them
    notes.addFilter(_drop)
    try:
        open_broker(broker_url, state_dir=state_dir).close()
    except Exception:  # (a warm-up: each slot meets the same error and says it)
        return
    finally:
        notes.removeFilter(_drop)


def _drop(record: logging.LogRecord) -> bool:
    return False
