"""Two minutes of an every-second ``@app.periodic`` job run end to end (issue 19's "done
when"): real ``qcluster manager`` processes import the app for its declaration, a real
master's slot runs the jobs and records each tick it ran. Meanwhile a second manager is
started by mistake, each manager is SIGKILLed and restarted, and once no manager runs for
5 s. Every tick from the first to the last is run exactly once (the slots' ledger), none
enqueued or run before its time. Redis and RabbitMQ; ``make soak`` runs it (about 2 min each).
"""

from __future__ import annotations

import collections
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import free_port, wait_until
from tests.e2e.cluster import Procs, try_json

pytestmark = pytest.mark.slow
APP = "tests.apps.periodic_app"
TOKEN = "e2e-periodic-soak-4b2d8f6a1c3e5a7b"
SOAK_S = 120.0


def ledger(log_dir: Path) -> list[tuple[int, float, float]]:
    """Every run the slots recorded: (tick ms, enqueued_at, ran_at)."""
    runs = []
    for path in log_dir.glob("ticks-*.log"):
        for line in path.read_text().splitlines():
            tick, enqueued_at, ran_at = line.split()
            runs.append((int(tick), float(enqueued_at), float(ran_at)))
    return runs


class Soak:
    def __init__(self, tmp_path: Path, broker_url: str) -> None:
        self.prefix = f"ps{uuid.uuid4().hex[:8]}"
        self.logs = tmp_path / "ticks"
        self.logs.mkdir()
        self.config = tmp_path / "qcluster.toml"
        self.config.write_text(f'app = "{APP}"\n[manager]\ninterval_s = 0.5\n'
                               '[master]\nreport_interval_s = 0.5\n')
        self.procs = Procs(tmp_path, {"QC_TEST_PREFIX": self.prefix,
                                      "QC_TEST_LOG_DIR": str(self.logs),
                                      "QCLUSTER_TOKEN": TOKEN,
                                      "QCLUSTER_METRICS_DIR": str(tmp_path / "metrics")})
        self.broker_url = broker_url
        self.port = free_port()  # the manager the master reports to
        self.managers: dict[str, Any] = {}

    def start_manager(self, name: str, port: int) -> None:
        self.managers[name] = self.procs.start(
            name, "manager", "--config", str(self.config), "--broker", self.broker_url,
            "--listen", f"127.0.0.1:{port}")
        wait_until(lambda: try_json(port, "/healthz"), timeout_s=60,
                   message=f"manager {name} up")

    def kill_manager(self, name: str) -> None:
        proc = self.managers.pop(name)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def start_master(self) -> None:
        self.procs.start("master", "master", "--app", APP, "--config", str(self.config),
                         "--broker", self.broker_url, "--host-name", "soak",
                         "--manager", f"http://127.0.0.1:{self.port}",
                         "--listen", f"127.0.0.1:{free_port()}")

    def ran(self) -> int:
        return len(ledger(self.logs))


@pytest.mark.parametrize("backend", ["redis", "rabbitmq"])
def test_two_minutes_of_kills_restarts_and_a_second_manager_run_each_tick_once(
        backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    soak = Soak(tmp_path, str(request.getfixturevalue(f"{backend}_url")))
    started = time.time()

    def at(offset_s: float) -> None:  # the scenario's clock: a step starts at its time
        time.sleep(max(0.0, started + offset_s - time.time()))

    try:
        soak.start_manager("first", soak.port)
        soak.start_master()
        wait_until(lambda: soak.ran() > 0, timeout_s=90, message="the slot runs ticks")
        at(20)
        soak.start_manager("mistake", free_port())
        at(40)
        soak.kill_manager("first")
        at(55)
        soak.start_manager("first-again", soak.port)
        at(75)
        soak.kill_manager("mistake")
        at(90)
        soak.kill_manager("first-again")
        time.sleep(5.0)  # no manager: every tick of these 5 s is missed (missed_after 1 s)
        soak.start_manager("last", soak.port)
        at(SOAK_S)
        stopped_at = time.time()
        soak.kill_manager("last")
        # The slot runs what was enqueued before the last manager stopped.
        wait_until(lambda: max(t for t, _, _ in ledger(soak.logs)) >= stopped_at * 1000 - 3000,
                   timeout_s=90, message="the slot ran the last ticks")
        time.sleep(2.0)  # a duplicate would run now
    finally:
        soak.procs.stop_all()

    runs = ledger(soak.logs)
    counts = collections.Counter(tick for tick, _, _ in runs)
    twice = sorted(tick for tick, count in counts.items() if count > 1)
    ticks = sorted(counts)
    lost = sorted(set(range(ticks[0], ticks[-1] + 1000, 1000)) - set(ticks))
    logs = {name: soak.procs.log(name)[-3000:] for name in
            ("first", "mistake", "first-again", "last")}
    print(f"{backend}: {len(ticks)} ticks run from {ticks[0]} to {ticks[-1]}, "
          f"{len(twice)} twice, {len(lost)} lost")
    assert not twice, f"ticks run twice: {twice}\n{logs}"
    assert not lost, f"ticks never run: {lost}\n{logs}"
    assert len(ticks) >= SOAK_S - 15, "the ticks do not cover the soak"
    assert all(enqueued_at * 1000 >= tick and ran_at * 1000 >= tick
               for tick, enqueued_at, ran_at in runs), "a tick enqueued or run early"
