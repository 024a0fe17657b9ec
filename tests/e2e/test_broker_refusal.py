"""A broker error that no retry can fix ends the slot with its reason, logged once, and
under a master marks the queue fatal with that reason (real RabbitMQ: a classic queue
where the app wants a quorum one). Before, the slot logged the mismatch every second for
as long as it ran, never exiting."""

from __future__ import annotations

import subprocess

from qcluster import exitcodes
from qcluster.broker import open_broker
from qcluster.client import Client
from tests.conftest import QCLUSTER, ROOT, free_port, qcluster_env, wait_until
from tests.e2e.cluster import Procs, get_json

APP = "tests.e2e.refusal_app:app"


def _make_classic(url: str, queue: str) -> None:
    with Client(url) as client:  # no app: the queue is declared classic
        client.enqueue(queue, "x")


def _delete(url: str, queue: str) -> None:
    broker = open_broker(url)
    try:
        broker.delete_queue(queue)
    finally:
        broker.close()


def test_a_slot_stops_once_with_its_reason_when_the_queue_has_another_type(
    rabbitmq_url: str, prefix: str
) -> None:
    queue = f"{prefix}-quorum"
    _make_classic(rabbitmq_url, queue)
    try:
        done = subprocess.run(
            [*QCLUSTER, "slot", "--app", APP, "--queue", queue, "--broker", rabbitmq_url],
            cwd=ROOT, env=qcluster_env(QC_TEST_PREFIX=prefix), capture_output=True,
            text=True, timeout=60)
    finally:
        _delete(rabbitmq_url, queue)
    log = done.stderr
    assert done.returncode == exitcodes.BROKER_REFUSED, log
    assert log.count(f"cannot serve {queue}: ") == 1, log
    assert "exists in RabbitMQ as a classic queue" in log
    assert "No retry can fix this: the slot stops (exit 20)" in log
    assert "broker error" not in log, log


def test_under_a_master_the_queue_is_marked_fatal_with_the_reason(
    procs: Procs, rabbitmq_url: str, prefix: str
) -> None:
    queue = f"{prefix}-quorum"
    _make_classic(rabbitmq_url, queue)
    port = free_port()
    try:
        procs.start("master", "master", "--app", APP, "--broker", rabbitmq_url, "--slots",
                    f"{queue}=2", "--listen", f"127.0.0.1:{port}", "--host-name", "test")
        wait_until(lambda: queue in _fatal(port), timeout_s=60, message="queue marked fatal")
        reason = _fatal(port)[queue]
        assert reason.startswith("the broker refused it: ") and "classic queue" in reason
        log = procs.log("master")
        assert f"queue {queue} is fatal on this host: the broker refused it: " in log
        wait_until(lambda: all(s["queue"] != queue for s in get_json(port, "/api/v1/slots")),
                   timeout_s=60, message="no slot of the queue left")
        assert log.count("cannot serve") <= 2, log  # one line per slot, each once
    finally:
        procs.stop_all()
        _delete(rabbitmq_url, queue)


def _fatal(port: int) -> dict[str, str]:
    try:
        return dict(get_json(port, "/api/v1/host").get("fatal") or {})
    except OSError:
        return {}
