"""The manager's ticker (manager/planning/periodic.py) on a real Redis, with a clock the test moves:
ticks enqueued once across two tickers, a job's first tick after the manager started, a
failed publish leaves the tick to the next pass, missed ticks per
catch_up, and what the admin page is given."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from qcluster.broker import open_broker
from qcluster.broker.base import Broker
from qcluster.broker.redis_broker import PERIODIC_KEY, RedisBroker
from qcluster.broker.redis_client import client_options
from qcluster.errors import BrokerError, BrokerUnavailable
from qcluster.job import decode_envelope
from qcluster.manager.planning.periodic import PeriodicTicker
from qcluster.periodic import periodic_spec

#: 2030-01-01T00:00:00Z: a whole minute, so every-second ticks are easy to name.
T0 = 1_893_456_000.0


class Clock:
    def __init__(self, at: float) -> None:
        self.at = at

    def __call__(self) -> float:
        return self.at


@pytest.fixture
def broker(redis_url: str) -> Iterator[Broker]:
    opened = open_broker(redis_url)
    yield opened
    opened.close()


def ticker(broker: Broker, clock: Clock, queue: str, name: str,
           **fields: object) -> PeriodicTicker:
    spec = periodic_spec(name, {"queue": queue, "every": 1, **fields}, where="test")
    return PeriodicTicker({name: spec}, broker, threading.Lock(), clock)


def enqueued(broker: Broker, queue: str) -> list[int]:
    """The ticks of the queue's jobs, taken and acked."""
    ticks = []
    while batch := broker.take(queue, max_jobs=500, lock_timeout_s=60):
        ticks += [int(decode_envelope(d.body).headers["qcluster-tick"]) for d in batch]
        broker.ack(queue, batch)
    return sorted(ticks)


def ms(seconds: float) -> int:
    return round(seconds * 1000)


def test_two_tickers_enqueue_each_tick_once_from_the_managers_start(
        broker: Broker, queue_name: str) -> None:
    name, clock = f"j-{uuid.uuid4().hex[:8]}", Clock(T0 + 0.5)
    first = ticker(broker, clock, queue_name, name)
    second = ticker(broker, clock, queue_name, name)
    assert first.run_due() == pytest.approx(0.5)  # seconds to the next tick
    clock.at = T0 + 3.2
    first.run_due()
    second.run_due()
    clock.at = T0 + 4.0
    second.run_due()
    first.run_due()
    assert enqueued(broker, queue_name) == [ms(T0 + 1), ms(T0 + 2), ms(T0 + 3), ms(T0 + 4)]
    assert first.enqueued + second.enqueued == 4
    view = first.views()[0]
    assert view.last_run == T0 + 4 and view.next_run == T0 + 5
    assert view.schedule == "every 1 s" and view.queue == queue_name


def test_a_failed_publish_leaves_the_tick_to_the_next_pass(broker: Broker,
                                                          queue_name: str) -> None:
    name, clock = f"j-{uuid.uuid4().hex[:8]}", Clock(T0 + 0.5)
    failing = ticker(broker, clock, queue_name, name)
    original = broker.publish_tick

    def refuse(*args: object) -> bool:
        raise BrokerUnavailable("the broker went away")

    clock.at = T0 + 1.5
    broker.publish_tick = refuse  # type: ignore[method-assign, assignment]
    with pytest.raises(BrokerUnavailable):
        failing.run_due()
    broker.publish_tick = original  # type: ignore[method-assign]
    assert name not in broker.last_ticks()  # nothing was recorded
    started_earlier = Clock(T0)
    other = ticker(broker, started_earlier, queue_name, name)  # another manager
    started_earlier.at = T0 + 2.5
    other.run_due()
    assert enqueued(broker, queue_name) == [ms(T0 + 1), ms(T0 + 2)]


@pytest.mark.parametrize(("catch_up", "expected_missed"), [
    ("skip", 0), ("latest", 1), (5, 5),
])
def test_ticks_missed_while_no_manager_ran(broker: Broker, queue_name: str,
                                           catch_up: object, expected_missed: int) -> None:
    name, clock = f"j-{uuid.uuid4().hex[:8]}", Clock(T0 + 0.5)
    before = ticker(broker, clock, queue_name, name, catch_up=catch_up, missed_after=10)
    clock.at = T0 + 1.5
    before.run_due()  # T0 + 1 enqueued; then no manager for 100 s
    clock.at = T0 + 101.5
    ticker(broker, clock, queue_name, name, catch_up=catch_up, missed_after=10).run_due()
    missed = [ms(T0 + s) for s in range(87, 92)][5 - expected_missed:] if expected_missed else []
    on_time = [ms(T0 + s) for s in range(92, 102)]  # within missed_after (10 s) of now
    assert enqueued(broker, queue_name) == [ms(T0 + 1), *missed, *on_time]


def test_a_tick_stored_on_the_master_but_not_on_a_replica_is_enqueued_once(
        redis_url: str, queue_name: str) -> None:
    """WAIT finds no replica (this Redis has none): the publish raises
    ReplicationUnconfirmed after the job is stored on the master. The tick is recorded
    with it, so the next pass does not publish the tick again (it ran twice when the claim
    was given back and the first copy had been taken meanwhile)."""
    client = redis.Redis.from_url(redis_url, **client_options(3))
    waiting = RedisBroker(client, safe_url="redis://test", replicas=1, replica_timeout_ms=50)
    slot = open_broker(redis_url)
    try:
        name, clock = f"j-{uuid.uuid4().hex[:8]}", Clock(T0 + 0.5)
        tick = ticker(waiting, clock, queue_name, name)
        clock.at = T0 + 1.5
        taken = []
        for _ in range(3):
            with contextlib.suppress(BrokerError):  # the code before the fix raised here
                tick.run_due()
            batch = slot.take(queue_name, max_jobs=10, lock_timeout_s=60)
            taken += [int(decode_envelope(d.body).headers["qcluster-tick"]) for d in batch]
            slot.ack(queue_name, batch)
        assert taken == [ms(T0 + 1)]
        assert slot.last_ticks()[name] == ms(T0 + 1)
    finally:
        slot.close()
        waiting.close()


def test_a_bad_record_stops_only_its_own_job(broker: Broker, queue_name: str,
                                             redis_url: str) -> None:
    """A record that is not a number, and one far in the future, are each skipped (warned);
    the other job's ticks go on."""
    clock = Clock(T0 + 0.5)
    good, garbled, future = (f"{kind}-{uuid.uuid4().hex[:8]}"
                             for kind in ("good", "garbled", "future"))
    specs = {name: periodic_spec(name, {"queue": queue_name, "every": 1}, where="test")
             for name in (garbled, future, good)}
    manager = PeriodicTicker(specs, broker, threading.Lock(), clock)
    raw = redis.Redis.from_url(redis_url)
    raw.hset(PERIODIC_KEY, mapping={garbled: "soon", future: str(10**300)})
    try:
        clock.at = T0 + 2.5
        manager.run_due()
        assert enqueued(broker, queue_name) == [ms(T0 + 1), ms(T0 + 2)]  # good's only
        assert {view.name for view in manager.views()} == set(specs)  # the page still shows
        assert broker.last_ticks()[good] == ms(T0 + 2)
        assert garbled not in broker.last_ticks()
    finally:
        raw.hdel(PERIODIC_KEY, garbled, future)
        raw.close()


def test_the_broker_lock_is_taken_per_tick_not_per_pass(broker: Broker,
                                                         queue_name: str) -> None:
    """A pass catching up many ticks takes the manager's broker lock for each tick's
    publish and lets it go between them, so the planning rounds and pause/drain are
    not held back for the whole pass."""
    name, clock = f"j-{uuid.uuid4().hex[:8]}", Clock(T0 + 0.5)
    lock = CountingLock()
    spec = periodic_spec(name, {"queue": queue_name, "every": 1}, where="test")
    manager = PeriodicTicker({name: spec}, broker, lock, clock)  # type: ignore[arg-type]
    held_at_claim: list[int] = []
    original = broker.publish_tick

    def claim_and_look(*args: Any) -> bool:
        held_at_claim.append(lock.taken)
        return original(*args)

    broker.publish_tick = claim_and_look  # type: ignore[method-assign, assignment]
    clock.at = T0 + 5.5
    manager.run_due()
    assert manager.enqueued == 5
    assert held_at_claim == [2, 3, 4, 5, 6]  # the read took it once, then once per tick
    assert not lock.held


class CountingLock:
    """A context-manager lock that counts how often it was taken."""

    def __init__(self) -> None:
        self.taken = 0
        self.held = False

    def __enter__(self) -> None:
        assert not self.held
        self.taken += 1
        self.held = True

    def __exit__(self, *exc: object) -> None:
        self.held = False
