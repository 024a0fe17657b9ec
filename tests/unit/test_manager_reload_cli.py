"""``qcluster reload [HOST] [--all] [--wait]`` against a manager served in this process
(uvicorn, its planning loop running, a real Redis behind it), with stand-in masters that
report over HTTP and act on the reload id their replies carry as a master does: what the
command prints and its exit code when every host takes it, when one fails, when it is
refused."""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import uvicorn
from typer.testing import CliRunner

from qcluster.broker import open_broker
from qcluster.cli import cli, register_commands
from qcluster.config import load_settings
from qcluster.controls_cli import RELOAD_FAILED, RELOAD_INCOMPLETE, RELOAD_REFUSED
from qcluster.exitcodes import CONFIG, USAGE
from qcluster.manager.api.app import create_app
from qcluster.manager.reloads.rollout import ReloadBook
from qcluster.manager.service import ManagerService
from qcluster.manager.state import ClusterState
from qcluster.messages import CodeInfo, ReloadState
from tests.conftest import free_port, wait_until
from tests.unit.test_manager_state import report

TOKEN = "unit-reload-cli-8e2a4c6b1d3f5a7c"
OPS_TOKEN = "unit-reload-cli-ops-3c5e7a9b2d4f6a8c"


@dataclass
class StandInMaster:
    """Reports every 0.1 s; a new reload id in a reply makes it load, roll for a few
    reports, then end idle on the next generation (or failed, with ``error``)."""

    url: str
    host: str
    error: str = ""
    seen: str | None = None
    state: ReloadState = "idle"
    generation: int = 0
    reload_id: str = ""
    left: int = 0
    hold: bool = False
    """Keep rolling until the test lets it finish."""
    states: list[ReloadState] = field(default_factory=list)
    """The state of each report sent."""

    def report_once(self) -> None:
        code = CodeInfo(version=f"v{self.generation + 1}", generation=self.generation,
                        state=self.state, error=self.error if self.state == "failed" else "",
                        reload_id=self.reload_id)
        body = report(self.host, {"mail": 1}).model_copy(update={"code": code})
        reply = httpx.post(self.url + "/api/v1/reports", json=body.model_dump(mode="json"),
                           headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).json()
        self.states.append(self.state)
        self.step(reply["reload_id"])

    def step(self, asked: str) -> None:
        if self.seen is None:  # the first id after a start is taken as done
            self.seen = asked
        elif asked and asked != self.seen:
            self.seen, self.reload_id, self.state, self.left = asked, asked, "loading", 3
        elif self.state in ("loading", "rolling"):
            self.left -= 0 if self.hold else 1
            self.state = "rolling" if self.left > 0 else ("failed" if self.error else "idle")
            if self.state == "idle":
                self.generation += 1


@dataclass
class Cluster:
    url: str
    service: ManagerService
    masters: list[StandInMaster]
    timeline: list[tuple[ReloadState, ...]]
    """Every master's state after each round of reports."""


@pytest.fixture
def cluster(redis_url: str) -> Iterator[Cluster]:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "qcluster.toml"
        path.write_text("[manager]\ninterval_s = 0.3\n")
        settings = load_settings(path)
    broker = open_broker(redis_url)
    service = ManagerService(ClusterState(settings), broker, TOKEN, tokens={"ops": OPS_TOKEN})
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, message="manager served")
    url = f"http://127.0.0.1:{port}"
    masters = [StandInMaster(url, "a"), StandInMaster(url, "b", error="")]
    stop = threading.Event()
    timeline: list[tuple[ReloadState, ...]] = []

    def reporting() -> None:
        while not stop.wait(0.1):
            for master in masters:
                master.report_once()
            timeline.append(tuple(master.state for master in masters))

    for master in masters:
        master.report_once()
    reporter = threading.Thread(target=reporting, daemon=True)
    reporter.start()
    yield Cluster(url, service, masters, timeline)
    stop.set()
    reporter.join(10)
    server.should_exit = True
    thread.join(30)
    broker.close()


def run(*args: str, token: str | None = OPS_TOKEN) -> tuple[int, str]:
    register_commands()
    env = {"QCLUSTER_TOKEN": token, "QCLUSTER_MANAGER_URL": None, "QCLUSTER_CONFIG": None}
    result = CliRunner().invoke(cli, list(args), env=env)
    return result.exit_code, result.output


def test_reload_all_wait_follows_each_host_to_the_end(cluster: Cluster) -> None:
    code, output = run("reload", "--all", "--wait", "--manager", cluster.url)
    assert code == 0, output
    lines = output.splitlines()
    assert lines[0].startswith("reload r") and lines[0].endswith("asked by ops: a, b, one at "
                                                                 "a time")
    steps = [line for line in lines if line.startswith(("a: ", "b: "))]
    assert steps[0] == "a: asked"  # the POST's answer; b's may fall between two polls
    assert [line for line in steps if not line.endswith(": asked")] == [
        "a: took, version v1 -> v2, generation 1", "b: took, version v1 -> v2, generation 1"]
    assert lines[-1] == "reload done: 2 of 2 host(s) took the new code"
    assert [master.generation for master in cluster.masters] == [1, 1]
    busy = [sum(s in ("loading", "rolling") for s in states) for states in cluster.timeline]
    assert max(busy) == 1  # one host at a time


def test_a_failed_host_stops_the_rollout_and_exits_with_its_error(cluster: Cluster) -> None:
    cluster.masters[0].error = "SyntaxError: [red]bad[/red] line 3"
    code, output = run("reload", "--all", "--wait", "--manager", cluster.url)
    assert code == RELOAD_FAILED, output
    assert "a: failed, SyntaxError: [red]bad[/red] line 3" in output  # shown as sent
    assert "reload stopped: a failed: SyntaxError: [red]bad[/red] line 3; not asked, still " \
           "on the old code: b" in " ".join(output.split())
    assert cluster.masters[1].generation == 0 and cluster.masters[1].states[-1] == "idle"
    assert "b: asked" not in output


def test_one_host_without_wait_and_the_refusals(cluster: Cluster) -> None:
    cluster.masters[1].hold = True
    code, output = run("reload", "b", "--manager", cluster.url)
    assert code == 0 and "asked by ops: b" in output, output
    code, output = run("reload", "a", "--manager", cluster.url)
    assert code == RELOAD_REFUSED and "409" in output and "is running" in output, output
    cluster.masters[1].hold = False
    wait_until(lambda: cluster.masters[1].generation == 1, message="b reloaded")
    assert cluster.masters[0].generation == 0
    code, output = run("reload", "nobody", "--manager", cluster.url)
    assert code == RELOAD_REFUSED and "404" in output, output
    assert run("reload", "--manager", cluster.url)[0] == USAGE
    assert run("reload", "a", "--all", "--manager", cluster.url)[0] == USAGE
    assert run("reload", "bad name", "--manager", cluster.url)[0] == USAGE
    assert run("reload", "a", "--manager", cluster.url, token=None)[0] == CONFIG


def test_wait_says_so_when_the_manager_forgot_the_rollout(cluster: Cluster) -> None:
    """A manager restart loses a rollout in progress: --wait ends with 14 and says why
    (the manager's memory is emptied here as a restart empties it)."""
    cluster.masters[0].hold = True  # a stays rolling
    forget = threading.Timer(1.5, lambda: setattr(cluster.service.state, "reloads",
                                                  ReloadBook()))
    forget.start()
    try:
        code, output = run("reload", "--all", "--wait", "--manager", cluster.url)
    finally:
        forget.cancel()
        cluster.masters[0].hold = False
    assert code == RELOAD_INCOMPLETE, output
    assert "no longer knows reload r" in " ".join(output.split())


def test_a_long_error_stays_on_its_line(cluster: Cluster) -> None:
    """A failed host's error was wrapped at 80 columns inside its words when the output is
    not a terminal (a CI log, a pipe to grep): 'No module \\nnamed ...'."""
    error = ("AppImportError: cannot import app module 'opsapp': No module named "
             "'nosuch_dependency_xyz' (a long line for any terminal)")
    cluster.masters[0].error = error
    code, output = run("reload", "--all", "--wait", "--manager", cluster.url)
    assert code == RELOAD_FAILED, output
    assert f"a: failed, {error}\n" in output
