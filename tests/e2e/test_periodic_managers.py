"""Periodic jobs run by real ``qcluster manager`` processes: two managers on one broker
(one started by mistake), one SIGKILLed, then both down for a while, then one restarted.
Each every-1 s tick is enqueued exactly once (counted by tick id), none before its time;
with ``catch_up`` the ticks missed while no manager ran are enqueued after the restart, and
with the default ``skip`` they are not. Redis and RabbitMQ."""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from qcluster.broker import open_broker
from qcluster.job import decode_envelope
from tests.conftest import free_port, wait_until
from tests.e2e.cluster import Procs, try_json

TOKEN = "e2e-periodic-8c1f5a3e9b7d2c4a"
#: Seconds no manager runs: well over the jobs' missed_after (1 and 2 s), so ticks are missed.
DOWN_S = 6.0


def write_config(path: Path, prefix: str) -> Path:
    path.write_text(f"""
[periodic.{prefix}-caught]
queue = "{prefix}-caught"
every = 1
missed_after = 1
catch_up = 100

[periodic.{prefix}-skipped]
queue = "{prefix}-skipped"
every = 1
missed_after = 2  # a pass late by a second on a busy machine is late, not missed
""")
    return path


class Managers:
    def __init__(self, procs: Procs, broker_url: str, config: Path) -> None:
        self.procs, self.broker_url, self.config = procs, broker_url, config
        self.running: dict[str, tuple[int, object]] = {}

    def start(self, name: str) -> None:
        port = free_port()
        proc = self.procs.start(name, "manager", "--config", str(self.config), "--broker",
                                self.broker_url, "--listen", f"127.0.0.1:{port}")
        wait_until(lambda: try_json(port, "/healthz"), timeout_s=60,
                   message=f"manager {name} up")
        self.running[name] = (port, proc)

    def kill(self, name: str) -> None:
        _, proc = self.running.pop(name)
        os.killpg(proc.pid, signal.SIGKILL)  # type: ignore[attr-defined]
        proc.wait()  # type: ignore[attr-defined]


def ticks_in(broker_url: str, queue: str) -> list[tuple[int, float]]:
    """Every job of the queue as (tick, enqueued_at), taken and acked."""
    broker = open_broker(broker_url)
    found: list[tuple[int, float]] = []
    try:
        while batch := broker.take(queue, max_jobs=200, lock_timeout_s=60, wait_s=0.5):
            for delivery in batch:
                envelope = decode_envelope(delivery.body)
                assert envelope.id == f"periodic.{queue}.{envelope.headers['qcluster-tick']}"
                found.append((int(envelope.headers["qcluster-tick"]), envelope.enqueued_at))
            broker.ack(queue, batch)
    finally:
        broker.close()
    return found


def ready(broker_url: str, queue: str) -> int:
    broker = open_broker(broker_url)
    try:
        return broker.stats(queue).ready
    finally:
        broker.close()


@pytest.mark.parametrize("backend", ["redis", "rabbitmq"])
def test_two_managers_and_a_restart_enqueue_each_tick_once(
        backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    broker_url = str(request.getfixturevalue(f"{backend}_url"))
    prefix = f"pj{uuid.uuid4().hex[:8]}"
    caught, skipped = f"{prefix}-caught", f"{prefix}-skipped"
    procs = Procs(tmp_path, {"QCLUSTER_TOKEN": TOKEN})
    managers = Managers(procs, broker_url, write_config(tmp_path / "qcluster.toml", prefix))
    started = time.time()
    try:
        managers.start("first")
        managers.start("second")  # by mistake: both enqueue, or try to
        wait_until(lambda: ready(broker_url, caught) >= 3, message="3 ticks enqueued")
        managers.kill("first")
        seen = ready(broker_url, caught)
        wait_until(lambda: ready(broker_url, caught) >= seen + 3,
                   message="the second manager goes on alone")
        managers.kill("second")
        down_from = time.time()
        time.sleep(DOWN_S)  # no manager runs: ticks are missed
        managers.start("restarted")
        restarted_at = time.time()
        wait_until(lambda: ready(broker_url, skipped) > 0 and ready(broker_url, caught)
                   >= int(restarted_at - started) + 1,
                   message="the restarted manager catches up")
        managers.kill("restarted")
    finally:
        procs.stop_all()
    logs = "\n".join(procs.log(name) for name in ("first", "second", "restarted"))

    caught_ticks = ticks_in(broker_url, caught)
    ticks = sorted(tick for tick, _ in caught_ticks)
    assert len(ticks) == len(set(ticks)), f"a tick enqueued twice: {ticks}\n{logs}"
    assert ticks == list(range(ticks[0], ticks[-1] + 1000, 1000)), (
        f"a tick lost across the kill or the restart: {ticks}\n{logs}")
    assert ticks[0] >= int(started * 1000) - 1000
    assert ticks[-1] >= int(restarted_at * 1000) - 1000
    assert all(enqueued_at * 1000 >= tick for tick, enqueued_at in caught_ticks), "early"

    skipped_ticks = sorted(tick for tick, _ in ticks_in(broker_url, skipped))
    assert len(skipped_ticks) == len(set(skipped_ticks)), "a tick enqueued twice"
    during_down = [t for t in range(skipped_ticks[0], skipped_ticks[-1], 1000)
                   if t not in skipped_ticks]
    assert during_down, f"catch_up = skip enqueued the missed ticks: {skipped_ticks}"
    assert all(down_from * 1000 - 1000 <= t <= restarted_at * 1000 + 1000
               for t in during_down), "ticks lost while a manager ran"
