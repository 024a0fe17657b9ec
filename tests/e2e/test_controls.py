"""Pause and drain survive the manager: real ``qcluster manager`` processes, the real CLI.

A queue paused and a host drained through ``qcluster pause`` / ``qcluster drain`` are still
paused and drained, with the same who/when, after the manager is SIGKILLed and a new one
starts; a second manager sees a change made through the first; resume and undrain lift them.
On Redis and on RabbitMQ (where the controls are one document in a durable queue).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import QCLUSTER, free_port, qcluster_env, wait_until
from tests.e2e.cluster import Procs, get_json, get_text, try_json
from tests.unit.test_manager_state import report

TOKEN = "e2e-controls-7c1d9e3f5a2b4c6d"
#: A named token ([tokens] ops = ...): the manager shows "ops" as who drained the host.
OPS_TOKEN = "e2e-controls-ops-4b6d8f0a2c3e5a7b"
INTERVAL = "0.5"


@pytest.fixture(params=["redis", "rabbitmq"])
def url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(f"{request.param}_url"))


class Managers:
    def __init__(self, procs: Procs, broker_url: str, config: Path) -> None:
        self.procs, self.broker_url, self.config = procs, broker_url, config
        self.count = 0

    def start(self) -> tuple[subprocess.Popen[bytes], int]:
        port = free_port()
        self.count += 1
        proc = self.procs.start(f"manager-{self.count}", "manager", "--config", str(self.config),
                                "--broker", self.broker_url, "--listen", f"127.0.0.1:{port}",
                                "--interval", INTERVAL)
        wait_until(lambda: try_json(port, "/healthz") or proc.poll() is not None,
                   message="manager up")
        assert proc.poll() is None, self.procs.log(f"manager-{self.count}")
        return proc, port


def cli(port: int, *args: str, token: str = TOKEN) -> subprocess.CompletedProcess[str]:
    env = qcluster_env(QCLUSTER_TOKEN=token, QCLUSTER_MANAGER_URL=f"http://127.0.0.1:{port}")
    return subprocess.run([*QCLUSTER, *args], env=env, capture_output=True, text=True,
                          timeout=120)


def controls(port: int, names: set[str]) -> dict[str, dict[str, Any]]:
    """This test's controls (the broker may hold other tests'), by KIND:NAME."""
    found = try_json(port, "/api/v1/controls") or []
    return {f"{c['kind']}:{c['name']}": c for c in found if c["name"] in names}


def queue_paused(port: int, queue: str) -> bool | None:
    view = try_json(port, "/api/v1/cluster") or {"queues": []}
    return next((q["paused"] for q in view["queues"] if q["name"] == queue), None)


def test_pause_and_drain_survive_a_killed_manager(url: str, tmp_path: Path) -> None:
    suffix = uuid.uuid4().hex[:8]
    queue, host = f"ctl-{suffix}", f"host-{suffix}"
    config = tmp_path / "qcluster.toml"
    # The queue is declared here, so the manager plans it (and shows it) without a master.
    config.write_text(f"[queues.{queue}]\nmax_slots = 2\n")
    procs = Procs(tmp_path, {"QCLUSTER_TOKEN": TOKEN,
                             "QCLUSTER_TOKENS": json.dumps({"ops": OPS_TOKEN})})
    managers = Managers(procs, url, config)
    names = {queue, host}
    try:
        first, port = managers.start()
        paused = cli(port, "pause", queue)
        assert paused.returncode == 0, paused.stderr
        assert f"queue {queue} paused by token" in paused.stdout
        drained = cli(port, "drain", host, token=OPS_TOKEN)
        assert drained.returncode == 0, drained.stderr
        assert f"host {host} drained by ops" in drained.stdout
        before = controls(port, names)
        assert set(before) == {f"pause:{queue}", f"drain:{host}"}
        assert before[f"pause:{queue}"]["by"] == "token"
        assert before[f"drain:{host}"]["by"] == "ops"

        os.killpg(first.pid, signal.SIGKILL)  # no goodbye: the broker alone remembers
        first.wait()
        second, port = managers.start()
        # Read back before the first reply and at every round.
        wait_until(lambda: controls(port, names) == before, message="controls read back")
        wait_until(lambda: queue_paused(port, queue) is True, message="queue shown paused")
        page = get_text(port, "/")
        assert f'data-control="pause:{queue}"' in page and f'data-control="drain:{host}"' in page
        assert "ops" in page and OPS_TOKEN not in page and TOKEN not in page
        # The drained host's first report is answered with an empty row.
        body = report(host, {queue: 2}).model_dump(mode="json")
        reply = httpx.post(f"http://127.0.0.1:{port}/api/v1/reports", json=body,
                           headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        assert reply.status_code == 200 and reply.json()["row"] == {}

        # A second manager (started by mistake) sees what the first one changes.
        _, other = managers.start()
        wait_until(lambda: controls(other, names) == before, message="second manager reads")
        resumed = cli(port, "resume", queue)
        assert resumed.returncode == 0, resumed.stderr
        wait_until(lambda: set(controls(other, names)) == {f"drain:{host}"},
                   message="the second manager sees the resume")
        wait_until(lambda: queue_paused(port, queue) is False, message="queue resumed")
        undrained = cli(other, "undrain", host)
        assert undrained.returncode == 0, undrained.stderr
        wait_until(lambda: controls(port, names) == {} and controls(other, names) == {},
                   message="both managers see the undrain")
        listed = cli(port, "controls")
        assert listed.returncode == 0 and queue not in listed.stdout
        assert get_json(port, "/healthz")["status"] == "ok"
        second.send_signal(signal.SIGTERM)
    finally:
        procs.stop_all()


def test_pause_wait_returns_once_no_slot_runs_the_queue(redis_url: str, tmp_path: Path) -> None:
    """A paused queue's slots go at the manager's next round, each after its batch, and
    take its jobs until then: the tutorial's reader enqueued right after `qcluster pause`
    and saw the jobs run. `--wait` returns once the masters report none left."""
    suffix = uuid.uuid4().hex[:8]
    queue, host = f"ctl-{suffix}", f"host-{suffix}"
    config = tmp_path / "qcluster.toml"
    config.write_text(f"[queues.{queue}]\nmax_slots = 2\n")
    procs = Procs(tmp_path, {"QCLUSTER_TOKEN": TOKEN})

    def master_reports(slots: int) -> None:
        body = report(host, {queue: slots} if slots else {}).model_dump(mode="json")
        reply = httpx.post(f"http://127.0.0.1:{port}/api/v1/reports", json=body,
                           headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        assert reply.status_code == 200, reply.text

    try:
        _, port = Managers(procs, redis_url, config).start()
        master_reports(2)
        still = cli(port, "pause", queue, "--wait", "--timeout", "1")
        assert still.returncode == 1, still.stdout + still.stderr
        assert f"queue {queue} paused by token" in still.stdout
        assert f"queue {queue} is paused, but 2 slot(s) still run it after 1 s" in " ".join(
            still.stderr.split()), still.stderr
        env = qcluster_env(QCLUSTER_TOKEN=TOKEN, QCLUSTER_MANAGER_URL=f"http://127.0.0.1:{port}")
        waiting = subprocess.Popen([*QCLUSTER, "pause", queue, "--wait"], env=env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        master_reports(0)  # its slots stopped, as the manager's reply asked
        output, _ = waiting.communicate(timeout=120)
        assert waiting.returncode == 0, output
        assert output.rstrip().endswith(f"queue {queue}: no slot runs it"), output
    finally:
        procs.stop_all()
