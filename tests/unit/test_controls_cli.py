"""``qcluster pause|resume|drain|undrain|controls`` against a manager served in this process
(uvicorn, a real Redis broker): what it prints and its exit code on every path an operator
meets: done, no token, a wrong token, a bad name, the manager down, the broker down."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import uvicorn
from typer.testing import CliRunner

from qcluster.broker import open_broker
from qcluster.cli import cli, register_commands
from qcluster.config import load_settings
from qcluster.controls_cli import MANAGER_UNREACHABLE, TOKEN_REFUSED
from qcluster.errors import BrokerUnavailable
from qcluster.exitcodes import CONFIG, USAGE
from qcluster.manager.api.app import create_app
from qcluster.manager.controls.store import ControlStore
from qcluster.manager.service import ManagerService
from qcluster.manager.state import ClusterState
from tests.conftest import free_port, wait_until
from tests.unit.test_manager_state import report as host_report

TOKEN = "unit-controls-3f8a1c5e7b9d2a4c"
OPS_TOKEN = "unit-controls-ops-9d2b4f6a8c1e3a5b"


@dataclass
class Served:
    service: ManagerService
    url: str


@pytest.fixture
def manager(redis_url: str) -> Iterator[Served]:
    broker = open_broker(redis_url)
    service = ManagerService(ClusterState(load_settings(None)), broker, TOKEN,
                             tokens={"ops": OPS_TOKEN})
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, message="manager served")
    yield Served(service, f"http://127.0.0.1:{port}")
    server.should_exit = True
    thread.join(30)
    broker.close()


def run(*args: str, token: str | None = TOKEN, manager_url: str | None = None) -> tuple[int, str]:
    register_commands()
    env = {"QCLUSTER_TOKEN": token, "QCLUSTER_MANAGER_URL": manager_url, "QCLUSTER_CONFIG": None}
    result = CliRunner().invoke(cli, list(args), env=env)
    return result.exit_code, result.output


def test_pause_resume_drain_undrain_through_the_manager(manager: Served) -> None:
    queue, host = "cli-queue-1", "cli-host-1"
    code, output = run("pause", queue, "--manager", manager.url)
    assert code == 0, output
    assert f"queue {queue} paused by token" in output
    assert queue in manager.service.state.paused
    code, output = run("drain", host, "--manager", manager.url, token=OPS_TOKEN)
    assert code == 0 and f"host {host} drained by ops" in output, output
    shown = {(c.kind, c.name): c.by for c in manager.service.controls()}
    assert shown[("pause", queue)] == "token" and shown[("drain", host)] == "ops"
    code, output = run("controls", manager_url=manager.url)
    assert code == 0 and queue in output and host in output and "ops" in output
    assert TOKEN not in output and OPS_TOKEN not in output  # names, never the secrets
    code, output = run("controls", "--json", manager_url=manager.url)
    listed = {(c["kind"], c["name"]): c for c in json.loads(output)}
    assert code == 0 and listed[("drain", host)]["by"] == "ops"
    assert listed[("pause", queue)]["at"] > 0
    assert run("resume", queue, manager_url=manager.url)[0] == 0
    assert run("undrain", host, manager_url=manager.url)[0] == 0
    assert not {(c.kind, c.name) for c in manager.service.controls()} & {
        ("pause", queue), ("drain", host)}


def test_a_wrong_token_exits_11_and_changes_nothing(manager: Served) -> None:
    code, output = run("pause", "cli-queue-2", "--manager", manager.url,
                       token="not-the-token-0123456789")
    assert code == TOKEN_REFUSED == 11
    assert "refused the token" in output
    assert "cli-queue-2" not in manager.service.state.paused


def test_no_token_exits_6_before_any_request(manager: Served) -> None:
    code, output = run("drain", "cli-host-3", "--manager", manager.url, token=None)
    assert code == CONFIG == 6
    assert "QCLUSTER_TOKEN" in output


def test_a_name_outside_the_rule_exits_2_before_any_request(manager: Served) -> None:
    code, output = run("pause", "a b", "--manager", manager.url)
    assert code == USAGE == 2
    assert "invalid queue name" in output


def test_an_unreachable_manager_exits_10_naming_it() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    code, output = run("pause", "cli-queue-4", "--manager", url)
    assert code == MANAGER_UNREACHABLE == 10
    assert "unreachable" in output and url in output


class BrokerDown:
    def read_controls(self) -> dict[str, bytes]:
        return {}

    def write_control(self, key: str, value: bytes | None) -> None:
        raise BrokerUnavailable("Redis at redis://x unreachable: connection refused")


def test_a_change_the_broker_did_not_store_exits_10_and_changes_nothing(
        manager: Served) -> None:
    manager.service.control_store = ControlStore(BrokerDown())
    code, output = run("pause", "cli-queue-5", "--manager", manager.url)
    assert code == MANAGER_UNREACHABLE
    assert "503" in output and "did not store" in output
    assert "cli-queue-5" not in manager.service.state.paused


def test_a_stored_control_with_an_impossible_time_is_skipped(manager: Served,
                                                             redis_url: str) -> None:
    """The broker's data is not trusted: an entry whose ``at`` is NaN or far in the future
    (another program's write) is no control. Before, it was kept: GET /api/v1/controls
    answered 500 (NaN is no JSON), ``qcluster controls`` failed, the admin page too."""
    import redis

    from qcluster.broker.redis_broker import CONTROLS_KEY

    raw = redis.Redis.from_url(redis_url)
    bad = {"pause:cli-nan": '{"by": "x", "at": NaN}', "pause:cli-far": '{"by": "x", "at": 1e300}'}
    for key, value in bad.items():
        raw.hset(CONTROLS_KEY, key, value)
    try:
        assert run("pause", "cli-good", "--manager", manager.url)[0] == 0
        manager.service.read_controls()  # a round reads the broker's controls
        code, output = run("controls", "--json", manager_url=manager.url)
        assert code == 0, output
        names = [c["name"] for c in json.loads(output)]  # other tests' controls aside
        assert "cli-good" in names and not {"cli-nan", "cli-far"} & set(names)
        assert run("resume", "cli-good", manager_url=manager.url)[0] == 0
    finally:
        raw.hdel(CONTROLS_KEY, *bad)
        raw.close()


def test_a_control_on_a_name_no_master_reported_says_so(manager: Served) -> None:
    """`qcluster pause mial` (a typo for mail) answered 'queue mial paused ... no slot from
    the next planning round' and exited 0: the operator believed mail paused while its
    slots went on. The control is still kept (it may be set ahead of a deploy), with a note
    naming the closest known names; a known name gets no note."""
    manager.service.receive(host_report("host-a", {"mail": 1}))
    code, output = run("pause", "mial", "--manager", manager.url)
    assert code == 0 and "queue mial paused by token" in output, output
    assert "note: no master has reported a queue named 'mial' (did you mean mail?)" in output
    assert "qcluster resume mial" in output
    code, output = run("drain", "host-aa", "--manager", manager.url)
    assert code == 0 and "no host named 'host-aa' reports to this manager" in output, output
    assert "did you mean host-a?" in output
    for args in (("pause", "mail"), ("drain", "host-a")):
        code, output = run(*args, "--manager", manager.url)
        assert code == 0 and "note:" not in output, output
    reply = httpx.post(f"{manager.url}/api/v1/queues/mial/pause",
                       headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert reply["known"] is False and reply["like"] == ["mail"]
    for args in (("resume", "mial"), ("resume", "mail"), ("undrain", "host-aa"),
                 ("undrain", "host-a")):
        assert run(*args, "--manager", manager.url)[0] == 0
