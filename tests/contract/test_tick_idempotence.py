"""Periodic ticks and publishes that meet late replies and resets, on real brokers behind
a TCP proxy (tests/tcp_proxy.py), and publishing an id the queue holds.

- A tick whose publish answered late is not enqueued again (it ran twice: the ticker
  read the timeout as "stored nothing", gave its claim back, and published it again).
- A tick whose claim answered late is enqueued once (it was lost: the record had moved,
  later passes saw the tick as done).
- A tick whose RabbitMQ publisher confirm was lost to a reset is enqueued once (the
  publish was retried on a new connection).
- Publishing an id that is ready, delayed or locked changes nothing (it made a locked job
  ready for a second slot and dropped the first slot's retry); publish returns the ids
  stored as new.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import amqp
import pytest

from qcluster.broker import open_broker
from qcluster.broker.base import Broker, Settlement
from qcluster.broker.redis_broker import RedisBroker
from qcluster.errors import BrokerError
from qcluster.job import decode_envelope
from qcluster.manager.planning.periodic import TICK_HEADER, PeriodicTicker
from qcluster.periodic import periodic_spec
from tests.tcp_proxy import TcpProxy, proxied_redis

#: 2030-01-01T00:00:00Z.
T0 = 1_893_456_000.0
#: The proxy delays each way by LATE_S: a command reaches Redis before the client's
#: timeout, its reply after it (the call raises, the command ran).
SOCKET_TIMEOUT_S = 1.0
LATE_S = 0.7
#: How long a take waits for a tick that must be there. A take returns with the first job,
#: so this only bounds a failing test: RabbitMQ delivering to a new consumer within a
#: second is no promise on a loaded machine.
TICK_WAIT_S = 60.0


class Clock:
    def __init__(self, at: float) -> None:
        self.at = at

    def __call__(self) -> float:
        return self.at


def ms(seconds: float) -> int:
    return round(seconds * 1000)


def proxied(
        redis_url: str) -> contextlib.AbstractContextManager[tuple[RedisBroker, TcpProxy]]:
    """A RedisBroker through a proxy, its socket timeout short (the test waits less)."""
    return proxied_redis(redis_url, SOCKET_TIMEOUT_S)


def ticker(broker: Broker, clock: Clock, queue: str, name: str) -> PeriodicTicker:
    spec = periodic_spec(name, {"queue": queue, "every": 1}, where="test")
    return PeriodicTicker({name: spec}, broker, threading.Lock(), clock)


def taken_ticks(broker: Broker, queue: str, wait_s: float = 0.0) -> list[int]:
    ticks = []
    while batch := broker.take(queue, max_jobs=100, lock_timeout_s=60, wait_s=wait_s):
        ticks += [int(decode_envelope(d.body).headers[TICK_HEADER]) for d in batch]
        broker.ack(queue, batch)
        wait_s = 0.0
    return sorted(ticks)


def late_after(proxy: TcpProxy, call: Callable[..., Any]) -> Callable[..., Any]:
    """``call``, after which every reply is late (until the test restores the proxy)."""
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        result = call(*args, **kwargs)
        proxy.set_latency(LATE_S)
        return result
    return wrapped


def test_a_tick_whose_publish_answers_late_is_enqueued_once(redis_url: str,
                                                             queue_name: str) -> None:
    """The publish's reply comes after the client gave up: the tick is stored; a slot
    takes and finishes it; the next pass must not enqueue it again. Failed before the
    fix: ticks [T0+1, T0+1]."""
    name, clock = f"j-{uuid.uuid4().hex[:8]}", Clock(T0 + 0.5)
    slot = open_broker(redis_url)
    with proxied(redis_url) as (broker, proxy):
        run = broker._run

        def late_publish(script: str, keys: list[str], args: list[Any]) -> Any:
            if script in ("publish", "tick"):  # the enqueue, not the claim before it
                proxy.set_latency(LATE_S)
            try:
                return run(script, keys, args)
            finally:
                proxy.restore()

        broker._run = late_publish  # type: ignore[method-assign]
        manager = ticker(broker, clock, queue_name, name)
        clock.at = T0 + 1.5
        with pytest.raises(BrokerError):
            manager.run_due()
        first = taken_ticks(slot, queue_name, wait_s=LATE_S * 3)
        for _ in range(3):
            with contextlib.suppress(BrokerError):
                manager.run_due()
        assert first + taken_ticks(slot, queue_name) == [ms(T0 + 1)]
    slot.close()


def test_a_tick_whose_claim_answers_late_is_enqueued_once(redis_url: str,
                                                           queue_name: str) -> None:
    """The first script of the tick (the claim, before the fix) answers after the client
    gave up. The tick must still be enqueued, once. Failed before the fix: no tick at
    all (the record had moved, and later passes saw the tick as done)."""
    name, clock = f"j-{uuid.uuid4().hex[:8]}", Clock(T0 + 0.5)
    slot = open_broker(redis_url)
    with proxied(redis_url) as (broker, proxy):
        broker.last_ticks = late_after(proxy, broker.last_ticks)  # type: ignore[method-assign]
        manager = ticker(broker, clock, queue_name, name)
        clock.at = T0 + 1.5
        with pytest.raises(BrokerError):
            manager.run_due()
        proxy.restore()
        broker.last_ticks = type(broker).last_ticks.__get__(broker)  # type: ignore[method-assign]
        for _ in range(3):
            manager.run_due()
        assert taken_ticks(slot, queue_name, wait_s=TICK_WAIT_S) == [ms(T0 + 1)]
        assert slot.last_ticks()[name] == ms(T0 + 1)
    slot.close()


def test_a_tick_whose_confirm_is_lost_to_a_reset_is_enqueued_once(
        rabbitmq_url: str, queue_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """RabbitMQ: the tick's message reaches the broker, the link is reset before its
    publisher confirm comes back, the call is retried on a new connection. Failed before
    the fix: ticks [T0+1, T0+1] (the retry published it again)."""
    parts = urlsplit(rabbitmq_url)
    name, clock = f"j-{uuid.uuid4().hex[:8]}", Clock(T0 + 0.5)
    slot = open_broker(rabbitmq_url)
    with TcpProxy((parts.hostname or "127.0.0.1", parts.port or 5672)) as proxy:
        userinfo = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
        url = urlunsplit(parts._replace(netloc=f"{userinfo}127.0.0.1:{proxy.port}",
                                        query="heartbeat=2&connect_timeout=2"))
        broker = open_broker(url)
        reset: list[str] = []
        original = amqp.Channel._basic_publish

        def publish_then_reset(channel: Any, message: Any, exchange: str = "",
                               routing_key: str = "", *args: Any, **kwargs: Any) -> Any:
            result = original(channel, message, exchange, routing_key, *args, **kwargs)
            if routing_key == queue_name and not reset:
                reset.append(routing_key)
                time.sleep(0.5)  # RabbitMQ routes it; its confirm is on the way
                proxy.reset()
                raise ConnectionResetError("reset by the test before the confirm")
            return result

        monkeypatch.setattr(amqp.Channel, "_basic_publish", publish_then_reset)
        monkeypatch.setattr(amqp.Channel, "basic_publish", publish_then_reset)
        try:
            manager = ticker(broker, clock, queue_name, name)
            clock.at = T0 + 1.5
            with contextlib.suppress(BrokerError):
                manager.run_due()
            monkeypatch.undo()
            for _ in range(3):
                manager.run_due()
            assert reset
            assert taken_ticks(slot, queue_name, wait_s=TICK_WAIT_S) == [ms(T0 + 1)]
        finally:
            broker.close()
            slot.close()


# --- publishing an id the queue holds ----------------------------------------------


@pytest.fixture(params=["redis", "embedded"])
def redis_like_url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(f"{request.param}_url"))


def test_publishing_a_locked_id_again_changes_nothing(redis_like_url: str,
                                                      queue_name: str) -> None:
    """A job taken (locked) and published again: not taken by a second slot, its
    lock kept, so the first slot's retry still settles it. Failed before the fix: the
    second take got it, and the retry was dropped (its lock token overwritten)."""
    with contextlib.ExitStack() as stack:
        first, second = (stack.enter_context(contextlib.closing(open_broker(redis_like_url)))
                         for _ in range(2))
        first.publish(queue_name, "job-1", b'{"n": 1}')
        [taken] = first.take(queue_name, max_jobs=10, lock_timeout_s=60)
        stored = first.publish(queue_name, "job-1", b'{"n": 2}')
        assert second.take(queue_name, max_jobs=10, lock_timeout_s=60) == []
        assert stored is False
        first.settle(queue_name, Settlement(postpone=[(taken, 0.0)]))
        [again] = second.take(queue_name, max_jobs=10, lock_timeout_s=60, wait_s=TICK_WAIT_S)
        assert (again.id, again.body, again.attempts) == ("job-1", b'{"n": 1}', 2)


def test_publishing_a_waiting_id_again_keeps_it_as_it_is(redis_like_url: str,
                                                         queue_name: str) -> None:
    """Ready and delayed ids published again keep their body and their time; publish
    returns the ids stored as new, each once."""
    with contextlib.closing(open_broker(redis_like_url)) as broker:
        assert broker.publish_many(queue_name, [("a", b"1"), ("b", b"2")]) == ["a", "b"]
        assert broker.publish_many(queue_name, [("late", b"3")], delay_s=3600) == ["late"]
        assert broker.publish_many(
            queue_name, [("a", b"9"), ("late", b"9"), ("c", b"4"), ("c", b"5")]) == ["c"]
        assert broker.stats(queue_name).model_dump() == {
            "ready": 3, "locked": 0, "delayed": 1, "dead": 0}
        taken = broker.take(queue_name, max_jobs=10, lock_timeout_s=60)
        assert sorted((d.id, d.body) for d in taken) == [("a", b"1"), ("b", b"2"),
                                                         ("c", b"4")]


def test_rabbitmq_returns_every_id_as_new(rabbitmq_url: str, queue_name: str) -> None:
    """AMQP cannot look an id up: RabbitMQ stores every message (README, "Backend
    semantics"), and says so by returning every id."""
    with contextlib.closing(open_broker(rabbitmq_url)) as broker:
        assert broker.publish_many(queue_name, [("a", b"1"), ("a", b"2")]) == ["a"]


def test_a_tick_published_again_after_its_job_finished_stores_nothing(
        broker_url: str, queue_name: str) -> None:
    """Every backend (RabbitMQ classic and quorum): the record, not the job, says the
    tick is enqueued; a tick enqueued, taken and acked is refused the next time."""
    name = f"j-{uuid.uuid4().hex[:8]}"
    body = b'{"id": "x", "queue": "q", "payload": null, "enqueued_at": 0, ' \
           b'"headers": {"qcluster-tick": "1000"}}'
    with contextlib.closing(open_broker(broker_url)) as broker:
        assert broker.publish_tick(queue_name, name, 1_000, f"periodic.{name}.1000", body)
        assert taken_ticks(broker, queue_name, wait_s=TICK_WAIT_S) == [1_000]
        assert not broker.publish_tick(queue_name, name, 1_000, f"periodic.{name}.1000", body)
        assert taken_ticks(broker, queue_name, wait_s=0.5) == []
        assert broker.last_ticks()[name] == 1_000
