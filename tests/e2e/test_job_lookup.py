"""Job lookup on a real ``qcluster master`` and ``qcluster manager``: a job that fails twice
then succeeds and one that always fails are followed through ``qcluster job ID`` and
``GET /api/v1/jobs/{id}``: running, retrying with its last error, finished; dead with its
reason and traceback. On RabbitMQ, every state it can know (running, from the masters;
dead) and the rest answered
``unknown``, never a wrong state."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from qcluster.cli import cli, register_commands
from qcluster.client import Client
from tests.conftest import free_port, wait_until
from tests.e2e.cluster import Procs, try_json

APP = "tests.e2e.job_lookup_app:app"
#: Each job's states, in the order they may come; "finished" and "dead" are final.
FLAKY_STATES = {"ready", "running", "retrying", "finished"}
POISON_STATES = {"ready", "running", "retrying", "dead"}


class Lookups:
    """The API and the CLI asked about the same jobs; every state seen is kept."""

    def __init__(self, port: int, broker_url: str) -> None:
        self.port, self.broker_url = port, broker_url
        self.seen: dict[str, list[str]] = {}

    def api(self, job_id: str) -> dict[str, Any]:
        reply = httpx.get(f"http://127.0.0.1:{self.port}/api/v1/jobs/{job_id}", timeout=30)
        found = reply.json() if reply.status_code == 200 else {"state": f"http {reply.status_code}"}
        states = self.seen.setdefault(job_id, [])
        if not states or states[-1] != found["state"]:
            states.append(found["state"])
        return dict(found)

    def cli(self, job_id: str) -> dict[str, Any]:
        """``qcluster job ID --json``, as registered from the package's entry points."""
        register_commands()
        result = CliRunner().invoke(cli, ["job", job_id, "--json", "--broker", self.broker_url,
                                          "--manager", f"http://127.0.0.1:{self.port}"])
        assert result.exit_code == 0, result.output
        return dict(json.loads(result.output))

    def until(self, job_id: str, done: Callable[[dict[str, Any]], bool],
              what: str) -> dict[str, Any]:
        """The first answer of the API that ``done`` accepts (a state may not last)."""
        accepted: list[dict[str, Any]] = []

        def answered() -> bool:
            found = self.api(job_id)
            if done(found):
                accepted.append(found)
            return bool(accepted)

        wait_until(answered, timeout_s=60, interval_s=0.05,
                   message=f"{what} (seen: {self.seen.get(job_id)})")
        return accepted[0]


def start(procs: Procs, broker_url: str, prefix: str, tmp_path: Path) -> int:
    config = tmp_path / "qcluster.toml"
    one_slot = "min_slots = 1\nmax_slots = 1\n"
    # Reports every 0.5 s, as often as the manager plans: the running job's host shows sooner.
    config.write_text(f"[master]\nreport_interval_s = 0.5\n[queues.{prefix}-flaky]\n{one_slot}"
                      f"[queues.{prefix}-poison]\n{one_slot}")
    port = free_port()
    procs.start("manager", "manager", "--config", str(config), "--broker", broker_url,
                "--listen", f"127.0.0.1:{port}", "--interval", "0.5")
    # Planned by the manager (one slot per queue), reporting to it: the report names the
    # take each slot holds, which the lookup turns into a running job's host and slot.
    procs.start("master", "master", "--app", APP, "--broker", broker_url, "--config",
                str(config), "--host-name", "lookup", "--manager", f"http://127.0.0.1:{port}",
                "--listen", f"127.0.0.1:{free_port()}")
    wait_until(lambda: try_json(port, "/healthz"), timeout_s=60, message="manager up")
    return port


def enqueue(broker_url: str, prefix: str) -> tuple[str, str]:
    with Client(broker_url) as client:
        return (client.enqueue(f"{prefix}-flaky", {"to": "a@example.com"}),
                client.enqueue(f"{prefix}-poison", {"n": 1}))


@pytest.mark.parametrize("broker_url", ["redis", "embedded"], indirect=True)
def test_each_state_in_turn(procs: Procs, broker_url: str, prefix: str, logs: Path,
                            tmp_path: Path) -> None:
    flaky, poison = enqueue(broker_url, prefix)
    look = Lookups(start(procs, broker_url, prefix, tmp_path), broker_url)
    look.until(flaky, lambda job: job["state"] == "running" and job["host"] is not None,
               "the flaky job running, on the slot its master reports")
    running = look.api(flaky)
    # The slot is named as the logs, the metrics and a job's last error name it.
    assert running["host"] == "lookup" and running["slot"].isdigit(), running
    assert running["started_at"] <= time.time() and running["attempts"] == 1, running
    assert look.cli(flaky)["state"] == "running"  # it waits for the gate
    (logs / "gate").touch()
    error = look.until(flaky, lambda job: job["state"] == "retrying",
                       "the flaky job retrying")["last_error"]
    assert error is not None and error["type"].endswith("MailServerGone"), error
    assert "421 try again later" in error["message"] and error["host"] == "lookup"
    assert error["slot"] == running["slot"], (error, running)  # the slot that ran it
    retrying = look.cli(flaky)
    assert retrying["state"] in ("retrying", "ready", "running"), retrying
    if retrying["state"] == "retrying":
        assert retrying["next_run_at"] > time.time() - 1 and retrying["attempts"] >= 1
    look.until(poison, lambda job: job["state"] == "dead", "the poison job dead")
    dead = look.cli(poison)
    assert dead["state"] == "dead" and dead["attempts"] == 2, dead
    assert "ValueError" in dead["reason"] and dead["payload"] == {"n": 1}
    assert "raise ValueError" in dead["last_error"]["traceback"], dead
    look.until(flaky, lambda job: job["state"] == "finished", "the flaky job finished")
    finished = look.cli(flaky)
    assert finished["state"] == "finished", finished
    assert finished["attempts"] == 3 and finished["duration_s"] >= 0
    assert finished["finished_at"] >= finished["started_at"]
    for job_id, allowed in ((flaky, FLAKY_STATES), (poison, POISON_STATES)):
        assert set(look.seen[job_id]) <= allowed, look.seen
    assert look.seen[flaky][-1] == "finished" and look.seen[poison][-1] == "dead"


@pytest.mark.parametrize("broker_url", ["rabbitmq"], indirect=True)
def test_rabbitmq_answers_what_it_knows_and_never_a_wrong_state(
        procs: Procs, broker_url: str, prefix: str, logs: Path, tmp_path: Path) -> None:
    flaky, poison = enqueue(broker_url, prefix)
    look = Lookups(start(procs, broker_url, prefix, tmp_path), broker_url)
    # Running, as the masters answer: RabbitMQ cannot say who holds an unacked message.
    look.until(flaky, lambda job: job["state"] == "running", "the flaky job running")
    running = look.cli(flaky)
    assert running["host"] == "lookup" and running["slot"].isdigit(), running
    assert running["attempts"] == 1 and running["started_at"] <= time.time(), running
    (logs / "gate").touch()
    look.until(poison, lambda job: job["state"] == "dead", "the poison job dead")
    dead = look.api(poison)
    assert "ValueError" in dead["reason"] and dead["attempts"] == 2, dead
    wait_until(lambda: (logs / f"finished-{flaky}").exists() and bool(look.api(flaky)),
               timeout_s=60, interval_s=0.05, message="the flaky job finished")
    unknown = look.api(flaky)
    assert unknown["state"] == "unknown" and "RabbitMQ" in unknown["note"], unknown
    assert "slots holds it now" in unknown["note"], unknown
    assert set(look.seen[flaky]) <= {"unknown", "running"}, look.seen
    assert set(look.seen[poison]) <= {"unknown", "dead"} and look.seen[poison][-1] == "dead"
