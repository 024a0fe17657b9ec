"""The manager's service without HTTP and without a broker server: pause, resume and drain
take effect at the next round (and a drained host's next reply), reads change nothing, the
round prunes, and the FastAPI lifespan starts and stops the loop."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import cast

import pytest
from fastapi.testclient import TestClient

from qcluster.broker.base import Broker, DeadJob, QueueStats
from qcluster.errors import BrokerUnavailable
from qcluster.manager.api.app import create_app
from qcluster.manager.planning.recorder import Recorder
from qcluster.manager.service import ManagerService
from qcluster.policy import QueuePolicy
from tests.unit.test_manager_state import report as host_report
from tests.unit.test_manager_state import state


class FakeBroker:
    """The broker calls the service makes, answered from a dict of stats."""

    def __init__(self) -> None:
        self.ready: dict[str, int] = {}
        self.stats_calls = 0
        self.down: str | None = None
        """Every call but the controls' raises BrokerUnavailable with this reason."""
        self.controls: dict[str, bytes] = {}
        """The broker's durable controls store (pause, drain)."""

    def _answer(self) -> None:
        if self.down is not None:
            raise BrokerUnavailable(self.down)

    def stats(self, queue: str) -> QueueStats:
        self.stats_calls += 1
        self._answer()
        return QueueStats(ready=self.ready.get(queue, 0))

    def queues(self) -> list[str]:
        self._answer()
        return sorted(self.ready)

    def ping(self) -> None:
        self._answer()

    def durability(self) -> list[str]:
        return []

    def dead_jobs(self, queue: str, *, limit: int = 100) -> list[DeadJob]:
        return []

    def requeue_dead(self, queue: str) -> int:
        return 0

    safe_url = ""

    def kind(self) -> str:
        return type(self).__name__  # as a Broker whose URL names no known broker

    def redis_client(self) -> None:
        return None

    def read_controls(self) -> dict[str, bytes]:
        return dict(self.controls)

    def write_control(self, key: str, value: bytes | None) -> None:
        if value is None:
            self.controls.pop(key, None)
        else:
            self.controls[key] = value


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def service(window_s: float = 10.0) -> tuple[ManagerService, FakeBroker, Clock]:
    broker, clock = FakeBroker(), Clock()
    return (ManagerService(state(window_s=window_s), cast(Broker, broker), "s3cret",
                           clock=clock), broker, clock)


def test_a_paused_queue_gets_no_slot_from_the_next_round_until_resumed() -> None:
    manager, broker, clock = service()
    broker.ready["mail"] = 5000
    manager.receive(host_report("a", {"mail": 2}))
    manager.round()
    assert manager.state.slot_map["a"]["mail"] > 2
    manager.pause("mail")
    assert manager.state.slot_map["a"]["mail"] > 2  # a command, applied by the round
    clock.now += 1
    manager.round()
    assert manager.state.slot_map["a"].get("mail", 0) == 0
    assert next(q for q in manager.cluster_view().queues if q.name == "mail").paused
    manager.resume("mail")
    clock.now += 1
    manager.round()
    assert manager.state.slot_map["a"]["mail"] > 0
    assert not next(q for q in manager.cluster_view().queues if q.name == "mail").paused


def test_a_drained_host_gets_an_empty_row_at_once_and_its_slots_move() -> None:
    manager, broker, clock = service()
    broker.ready["mail"] = 5000
    manager.receive(host_report("a", {"mail": 2}))
    manager.receive(host_report("b", {"mail": 2}))
    manager.round()
    assert manager.state.slot_map["b"]
    manager.drain("b")
    assert manager.receive(host_report("b", {"mail": 2})).row == {}  # before any round
    clock.now += 1
    manager.round()
    assert "b" not in manager.state.slot_map and manager.state.slot_map["a"]["mail"] > 0
    hosts = {h.name: h.alive for h in manager.cluster_view().hosts}
    assert hosts == {"a": True, "b": False}


def test_reads_change_nothing_and_the_round_prunes_the_window() -> None:
    """ClusterState.window() dropped old samples on a read path (views, /metrics)."""
    manager, _, clock = service(window_s=10.0)
    manager.receive(host_report("a", {"mail": 1}, processed=50))
    clock.now += 60  # the sample is older than the window now
    manager.receive(host_report("a", {"mail": 1}, processed=50))
    held = manager.state.tracks["mail"].samples
    assert len(held) == 2
    view = manager.cluster_view()
    manager.state.window("mail", clock.now)
    manager.queue_history("mail")
    assert len(held) == 2  # read three ways: still held
    (mail,) = [q for q in view.queues if q.name == "mail"]
    assert mail.rate_out == 50.0  # ... and not counted: only the recent sample is
    manager.round()
    assert len(held) == 1


def test_the_round_observes_the_broker_then_decides_and_acts() -> None:
    manager, broker, _ = service()
    broker.ready["mail"] = 5000
    manager.receive(host_report("a", {"mail": 1}))
    observed = manager.observe()
    assert broker.stats_calls >= 1 and manager.state.stats["mail"].ready == 5000
    assert [q.name for q in observed.queues] == ["mail", "noop"]
    assert manager.state.slot_map == {}  # observing publishes nothing
    manager.round()
    assert manager.state.generation == 1 and manager.state.decisions
    assert manager.receive(host_report("a", {"mail": 1})).row == manager.state.slot_map["a"]


def test_the_lifespan_starts_and_stops_the_loop_and_closes_the_recording(
        tmp_path: Path) -> None:
    manager, _, _ = service()
    recorder = Recorder(tmp_path / "rec.jsonl", interval_s=1.0, started_at=1000.0)
    manager.recorder = recorder
    with TestClient(create_app(manager), base_url="http://127.0.0.1") as client:
        assert client.get("/healthz").status_code == 200
        thread = manager._thread
        assert thread is not None and thread.is_alive()
    assert not thread.is_alive() and manager.stopped.is_set()
    assert manager.recorder is None and recorder._file.closed
    manager.stop()  # twice is harmless


def test_without_the_lifespan_no_loop_runs() -> None:
    manager, _, _ = service()
    client = TestClient(create_app(manager), base_url="http://127.0.0.1")
    assert client.get("/healthz").status_code == 200
    assert manager._thread is None


def test_healthz_says_degraded_while_the_last_broker_read_failed() -> None:
    """Chaos row F8: /healthz said ok while every round logged the broker's refusal."""
    manager, broker, clock = service()
    client = TestClient(create_app(manager), base_url="http://127.0.0.1")
    manager.receive(host_report("a", {"mail": 1}))
    manager.round()
    assert client.get("/healthz").json() == {"status": "ok"}
    broker.down = "redis://127.0.0.1:1/0: Connection refused\n(after 3 attempts)"
    clock.now += 1
    manager.round()
    reply = client.get("/healthz")
    assert reply.status_code == 200  # alive: masters keep their rows meanwhile
    assert reply.json() == {"status": "degraded",
                            "broker": "redis://127.0.0.1:1/0: Connection refused"}
    manager.check_broker()  # the listing fails too
    assert client.get("/healthz").json()["status"] == "degraded"
    broker.down = None
    clock.now += 1
    manager.round()
    assert client.get("/healthz").json() == {"status": "ok"}


def test_with_no_queue_to_read_a_degraded_manager_pings_the_broker() -> None:
    manager, broker, _ = service()
    broker.down = "refused"
    manager.check_broker()
    assert manager.health() == {"status": "degraded", "broker": "refused"}
    manager.round()  # no queue known: nothing read but the ping
    assert manager.health()["status"] == "degraded"
    broker.down = None
    manager.round()
    assert manager.health() == {"status": "ok"}


def two_hosts_planned() -> tuple[ManagerService, Clock]:
    """A manager whose hosts a and b reported two mail slots each, after one round."""
    manager, broker, clock = service()
    broker.ready["mail"] = 5000
    manager.receive(host_report("a", {"mail": 2}))
    manager.receive(host_report("b", {"mail": 2}))
    manager.round()
    return manager, clock


def test_the_log_says_when_a_host_stops_reporting_and_when_it_is_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A master SIGKILLed: the page tags its host DEAD and the next round plans its slots
    elsewhere, but the manager's log said nothing (an operator reading the journal saw only
    the new plan's decisions). Now one line when a host starts, stops and starts again
    reporting, not one per round."""
    caplog.set_level(logging.INFO, logger="qcluster.manager.service")
    manager, clock = two_hosts_planned()

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "qcluster.manager.service"]

    assert lines() == ["host a reporting (capacity 6 slots)",
                       "host b reporting (capacity 6 slots)"]
    for _ in range(10):  # b is silent: expired after a few report intervals
        clock.now += 1
        manager.receive(host_report("a", {"mail": 2}))
        manager.round()
    assert [line for line in lines()[2:]] == [
        "host b stopped reporting (last report 6 s ago): its slots are planned on the other "
        "hosts"]
    manager.receive(host_report("b", {"mail": 0}))
    clock.now += 1
    manager.round()
    manager.round()
    assert lines()[3:] == ["host b reporting again (capacity 6 slots)"]


def test_a_queue_whose_hosts_all_stopped_keeps_its_row_and_its_backlog() -> None:
    """Every master of a queue gone (a bad deploy crashed them, or the only host drained):
    the queue left the API, the page ('No queue yet') and /metrics, and its backlog was no
    longer read, so the very outage hid the backlog growing and its alert could not fire.
    Now it keeps its row, read from the broker each round, with no slot planned."""
    manager, broker, clock = service()
    broker.ready["mail"] = 5000
    manager.receive(host_report("a", {"mail": 2}))
    manager.round()
    for _ in range(10):  # a is silent: expired
        clock.now += 1
        manager.round()
    assert {h.name: h.alive for h in manager.cluster_view().hosts} == {"a": False}
    broker.ready["mail"] = 7000
    clock.now += 1
    manager.round()
    rows = {q.name: q for q in manager.cluster_view().queues}
    assert rows["mail"].backlog == 7000 and rows["mail"].slots_planned == 0
    http = TestClient(create_app(manager), base_url="http://127.0.0.1")
    assert 'qcluster_queue_backlog{queue="mail"} 7000.0' in http.get("/metrics").text


def test_a_master_that_stops_cleanly_leaves_instead_of_staying_dead(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A host retired on purpose (its master stopped by systemctl stop, a scale-down) stayed
    DEAD on the page and qcluster_host_up 0 for as long as the manager ran, so the critical
    QclusterHostNotReporting alert fired until someone restarted the manager. A master's
    clean stop now says so and its host goes at once; a report brings it back."""
    caplog.set_level(logging.INFO, logger="qcluster.manager.service")
    manager, clock = two_hosts_planned()
    http = TestClient(create_app(manager), base_url="http://127.0.0.1")
    assert http.post("/api/v1/hosts/b/leave").status_code == 401  # a token is set
    reply = http.post("/api/v1/hosts/b/leave", headers={"Authorization": "Bearer s3cret"})
    assert reply.status_code == 200 and reply.json() == {"host": "b", "left": True}
    for _ in range(10):
        clock.now += 1
        manager.receive(host_report("a", {"mail": 2}))
        manager.round()
    assert [h.name for h in manager.cluster_view().hosts] == ["a"]
    assert "b" not in manager.state.slot_map
    assert 'host="b"' not in http.get("/metrics").text
    logged = [r.getMessage() for r in caplog.records if r.name == "qcluster.manager.service"]
    assert "host b left: its master stopped" in logged
    assert not any("stopped reporting" in line for line in logged)
    manager.receive(host_report("b", {"mail": 0}))
    clock.now += 1
    manager.round()
    assert {h.name: h.alive for h in manager.cluster_view().hosts} == {"a": True, "b": True}
    again = http.post("/api/v1/hosts/c/leave", headers={"Authorization": "Bearer s3cret"})
    assert again.json() == {"host": "c", "left": False}


def test_a_broker_down_costs_a_round_one_failed_read_not_one_per_queue() -> None:
    """Each read of a broker that is down waits for its connection retries (3 to 6 s seen
    on Redis and RabbitMQ). The round read every queue anyway, so with 150 queues a round
    took many minutes, /healthz said ok until its end and the log named every queue in
    turn. Now the first failure is in /healthz at once, and when the broker does not answer
    a ping either the other queues are not read this round; a queue failing alone (a
    Redis Cluster shard down) still leaves the others read."""
    manager, broker, clock = service()
    names = [f"q{n:03d}" for n in range(150)]
    policies = {name: QueuePolicy.model_validate({}) for name in names}
    manager.receive(host_report("a", {"q000": 1}, queues=policies))
    manager.round()
    assert broker.stats_calls == 150
    broker.down = "Connection refused"
    broker.stats_calls = 0
    clock.now += 1
    manager.round()
    assert broker.stats_calls == 1
    assert manager.health() == {"status": "degraded", "broker": "Connection refused"}


def test_one_queue_failing_while_the_broker_answers_leaves_the_others_read() -> None:
    manager, _, clock = service()
    broker = ShardDown()
    manager.broker = manager.watch.broker = cast(Broker, broker)
    policies = {name: QueuePolicy.model_validate({}) for name in ("a1", "b2", "c3")}
    manager.receive(host_report("a", {"a1": 1}, queues=policies))
    manager.round()  # the first round's full broker check is done
    broker.dead_shard = {"b2"}
    broker.stats_calls = 0
    clock.now += 1
    manager.round()
    assert broker.stats_calls == 3 and manager.health()["status"] == "degraded"
    rows = {q.name: q for q in manager.cluster_view().queues}
    assert rows["c3"].backlog == 7


class ShardDown(FakeBroker):
    """A broker whose queues in ``dead_shard`` fail while the rest (and a ping) answer."""

    def __init__(self) -> None:
        super().__init__()
        self.dead_shard: set[str] = set()

    def stats(self, queue: str) -> QueueStats:
        self.stats_calls += 1
        if queue in self.dead_shard:
            raise BrokerUnavailable(f"the shard of {queue} is down")
        return QueueStats(ready=7)
