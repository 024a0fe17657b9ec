"""Per-queue dead-letter retention (issue 15): ``dead_max_count`` / ``dead_max_age`` set in
``@app.queue(...)`` or ``[queues.NAME]``, passed by the slot to the broker with each
settle, applied to that queue's dead letters only, against the real brokers."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import pytest

from qcluster import App, Job
from qcluster.broker import Broker, DeadRetention, Settlement, open_broker
from qcluster.broker.kombu_broker import KombuBroker
from qcluster.config import load_settings
from qcluster.errors import ConfigError
from qcluster.job import Envelope
from qcluster.policy import QueuePolicy
from qcluster.slot.runtime import SlotRunner
from qcluster.slot.settle import settle_batch
from tests.conftest import wait_until


def envelopes(queue: str, ids: list[str]) -> list[tuple[str, bytes]]:
    return [(job_id, Envelope(id=job_id, queue=queue, payload=job_id, enqueued_at=time.time())
             .model_dump_json().encode()) for job_id in ids]


def failing_app(*queues: tuple[str, dict[str, object]]) -> App:
    app = App()
    for name, policy in queues:
        @app.queue(name, batch_size=1, **policy)
        def handle(jobs: list[Job]) -> None:
            for job in jobs:
                job.fail("no")
    return app


def run_until_empty(app: App, queue: str, url: str) -> None:
    """One in-process slot takes until the queue is empty (every job dead-lettered)."""
    broker = open_broker(url)
    runner = SlotRunner(app, queue, broker, burst=True)
    try:
        deadline = time.monotonic() + 30
        while broker.stats(queue).ready and time.monotonic() < deadline:
            runner.step()
    finally:
        runner._leave(queue)
        broker.close()


def take_one(broker: Broker, queue: str) -> list[object]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        taken = broker.take(queue, max_jobs=1, lock_timeout_s=60, wait_s=0.5)
        if taken:
            return list(taken)
    raise AssertionError(f"no job came from {queue}")


def test_a_queue_keeps_only_its_newest_dead_letters_and_others_are_untouched(
    broker_url: str, queue_name: str
) -> None:
    trimmed, other = queue_name, f"{queue_name}-other"
    app = failing_app((trimmed, {"dead_max_count": 3}), (other, {}))
    broker = open_broker(broker_url)
    try:
        broker.publish_many(other, envelopes(other, [f"o{i}" for i in range(4)]))
        run_until_empty(app, other, broker_url)
        broker.publish_many(trimmed, envelopes(trimmed, [f"j{i}" for i in range(5)]))
        run_until_empty(app, trimmed, broker_url)
        assert [d.id for d in broker.dead_jobs(trimmed)] == ["j4", "j3", "j2"]
        assert broker.stats(trimmed).dead == 3
        assert sorted(d.id for d in broker.dead_jobs(other)) == ["o0", "o1", "o2", "o3"]
        # RabbitMQ returns the letters dead_jobs peeked at when it closes the peeking
        # channel, after the call: a quorum queue's count can miss them for a moment.
        wait_until(lambda: broker.stats(other).dead == 4, timeout_s=60,
                   message="the other queue's 4 dead letters counted")
    finally:
        delete = getattr(broker, "delete_queue", None)
        if delete is not None:
            delete(other)
        broker.close()


def test_dead_max_age_drops_old_letters(broker_url: str, queue_name: str) -> None:
    """The broker's clock decides: a letter older than dead_max_age (1 s) is gone once the
    queue dead-letters again (Redis) or reaches the head of its store (RabbitMQ)."""
    retention = DeadRetention(max_count=100, max_age_s=1.0)
    broker = open_broker(broker_url)
    try:
        broker.publish_many(queue_name, envelopes(queue_name, ["old"]))
        (old,) = take_one(broker, queue_name)
        broker.dead(queue_name, old, "too old", retention=retention)  # type: ignore[arg-type]
        time.sleep(1.5)  # past the age on any clock: the verdict does not depend on speed
        broker.publish_many(queue_name, envelopes(queue_name, ["new"]))
        (new,) = take_one(broker, queue_name)
        broker.dead(queue_name, new, "recent", retention=retention)  # type: ignore[arg-type]
        assert [d.id for d in broker.dead_jobs(queue_name)] == ["new"]
    finally:
        broker.close()


def test_settle_batch_passes_the_queues_retention() -> None:
    policy = QueuePolicy.model_validate({"dead_max_count": 7, "dead_max_age": 3600})
    settlement, _ = settle_batch([], policy, rand=lambda: 0.5)
    assert settlement.retention == DeadRetention(7, 3600.0)
    assert Settlement().retention is None  # a broker's own default applies


def test_a_changed_count_on_rabbitmq_keeps_the_declared_store_and_warns(
    rabbitmq_url: str, queue_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Queue arguments cannot change: the store declared with 2 keeps 2 after the policy
    says 5, dead-lettering still works, and the operator is told once."""
    first, second = open_broker(rabbitmq_url), open_broker(rabbitmq_url)
    assert isinstance(first, KombuBroker) and isinstance(second, KombuBroker)
    try:
        first.publish_many(queue_name, envelopes(queue_name, [f"j{i}" for i in range(4)]))
        for broker, retention in ((first, DeadRetention(2)), (second, DeadRetention(5))):
            for _ in range(2):
                (delivery,) = take_one(broker, queue_name)
                with caplog.at_level(logging.WARNING):
                    broker.dead(queue_name, delivery, "no", retention=retention)  # type: ignore[arg-type]
            broker.leave(queue_name)  # its read-ahead goes back for the other one
        # 4 dead-lettered, the store keeps its 2 (the read-ahead given back went last)
        assert sorted(d.id for d in second.dead_jobs(queue_name)) == ["j2", "j3"]
        warnings = [r.getMessage() for r in caplog.records if "exists with other" in r.getMessage()]
        assert len(warnings) == 1 and "dead_max_count=5" in warnings[0], warnings
    finally:
        first.close()
        second.close()


BAD_VALUES = [
    ("dead_max_count", 0), ("dead_max_count", -1), ("dead_max_count", 1_000_001),
    ("dead_max_count", 2.5), ("dead_max_count", "many"),
    ("dead_max_age", 0), ("dead_max_age", 0.5), ("dead_max_age", math.nan),
    ("dead_max_age", math.inf), ("dead_max_age", 366 * 86_400), ("dead_max_age", "1d"),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_bad_retention_in_qcluster_toml_is_refused_with_one_line(
    tmp_path: Path, field: str, value: object
) -> None:
    rendered = {math.nan: "nan", math.inf: "inf"}.get(value, repr(value))  # type: ignore[call-overload]
    if isinstance(value, str):
        rendered = f'"{value}"'
    config = tmp_path / "qcluster.toml"
    config.write_text(f"[queues.mail]\n{field} = {rendered}\n")
    with pytest.raises(ConfigError) as refused:
        load_settings(config)
    # One line: the file, then the field and why (config.py's format).
    lines = str(refused.value).splitlines()
    assert len(lines) == 1 and f"queues.mail.{field}:" in lines[0], lines


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_bad_retention_in_app_queue_is_refused_with_one_line(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as refused:
        App().queue("mail", **{field: value})
    message = str(refused.value)
    assert "\n" not in message and f"queue 'mail': {field}: " in message, message


@pytest.mark.parametrize(("count", "age"), [(0, 60.0), (10, math.nan), (10, 0.0), (True, 60.0)])
def test_a_broker_refuses_a_bad_retention(count: int, age: float) -> None:
    with pytest.raises(ValueError, match="dead_max_"):
        DeadRetention(count, age)


def test_retention_in_qcluster_toml_reaches_the_policy(tmp_path: Path) -> None:
    config = tmp_path / "qcluster.toml"
    config.write_text("[queues.mail]\ndead_max_count = 50\ndead_max_age = 86400\n")
    app = failing_app(("mail", {}))
    policy = app.with_overrides(load_settings(config).queues).spec("mail").policy
    assert (policy.dead_max_count, policy.dead_max_age) == (50, 86_400.0)
