"""``qcluster demo``: a whole cluster on one machine, on the embedded broker.

A manager, two masters (host names ``demo-a`` and ``demo-b``, sized from memory and load), the
demo's app (``qcluster.demo.app``: queues of different priorities) and a load generator
whose arrival rates change over time, so the slot map visibly moves. Runs until Ctrl-C
(or ``--duration``); every child is stopped on the way out. The manager records what it
observed to ``<state dir>/demo-recording.jsonl``, which ``qcluster simulate --trace``
replays.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.markup import escape

from qcluster.cli_support import UsageError, check_port_free, settings_for, user_errors
from qcluster.demo.feed import Feed

out = Console()
TICK_S = 0.5
#: The resize queue's square wave: RESIZE_HIGH jobs/s, then RESIZE_LOW, every RESIZE_EDGE_S.
RESIZE_HIGH, RESIZE_LOW, RESIZE_EDGE_S = 1500.0, 50.0, 40.0
#: Seconds the demo waits for its manager before printing the admin URL without a login.
MANAGER_WAIT_S = 60.0
#: What the manager observed each round (``--record``), in the state directory.
RECORDING = "demo-recording.jsonl"


def arrival_rates(t: float) -> dict[str, float]:
    """Jobs/s per queue at ``t`` seconds into the demo: a square wave, a sine and bursts."""
    return {
        "resize": RESIZE_HIGH if (t // RESIZE_EDGE_S) % 2 == 0 else RESIZE_LOW,
        "mail": 150.0 + 150.0 * math.sin(t / 15.0),
        "noop": 40_000.0 if (t % 45) < 1.0 else 0.0,
    }


def payload(queue: str, n: int) -> dict[str, Any]:
    if queue == "mail":
        return {"to": f"user{n}@example.org" if n % 50 else "broken-address"}
    return {"n": n}


@dataclass
class Child:
    """One process of the demo's cluster."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def ended(self) -> str:
        """'' while it runs; else how it ended, with its log's last line (the reason)."""
        code = self.proc.poll()
        if code is None:
            return ""
        lines = self.log.read_text(errors="replace").strip().splitlines()
        return (f"the {self.name} exited (code {code}): "
                f"{lines[-1] if lines else 'nothing logged'}; its log: {self.log}")


def _spawn(name: str, args: list[str], log: Path, env: dict[str, str]) -> Child:
    with log.open("wb") as handle:  # the child holds its own copy
        proc = subprocess.Popen([sys.executable, "-m", "qcluster", *args], stdout=handle,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Child(name, proc, log)


def _summary(admin: str) -> str:
    from qcluster.admin_ui.display import load_text

    try:
        view = httpx.get(f"{admin}api/v1/cluster", timeout=2).json()
        parts = [
            f"{q['name']} {q['slots_current']}/{q['slots_planned']} slots, "
            f"backlog {q['backlog']}, load {load_text(q['load'])}"
            for q in view["queues"]
        ]
        return " | ".join([*parts, f"hosts {sum(h['alive'] for h in view['hosts'])}"])
    except (httpx.HTTPError, ValueError, LookupError, TypeError):
        # Not up yet, or not our manager answering (its child then exits: said next).
        return "manager starting..."


#: The highest TCP port.
MAX_PORT = 65535


def demo(
    duration: Annotated[
        float | None, typer.Option("--duration", help="Stop after S seconds (default: Ctrl-C)")
    ] = None,
    port: Annotated[int, typer.Option(
        "--port", help="Manager / admin UI port; the two masters take the next two")] = 7300,
    state_dir: Annotated[
        Path, typer.Option("--state-dir", help="Embedded broker state")
    ] = Path(".qcluster"),
) -> None:
    """A small cluster on the embedded broker with the admin UI, until Ctrl-C."""
    from qcluster.broker.embedded import ensure_server
    from qcluster.broker.embedded_life import hold, release

    with user_errors():  # the manager's port and the masters' after it, before any start
        if not 1 <= port <= MAX_PORT - 2:
            raise UsageError(f"--port: the manager takes P and the masters P+1 and P+2: give "
                             f"a P from 1 to {MAX_PORT - 2}, not {port}")
        for taken in range(port, port + 3):
            check_port_free("127.0.0.1", taken, "--port")
    state_dir = state_dir.resolve()
    hold(state_dir)  # the demo is the broker's last user: it stops it on the way out
    ensure_server(state_dir)
    logs = state_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    admin = f"http://127.0.0.1:{port}/"
    recording = state_dir / RECORDING
    recording.unlink(missing_ok=True)  # this run only: the manager appends to the file
    children = _spawn_cluster(port, recording, logs, _child_env(state_dir))
    stop = {"now": False}
    signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    link = _login_link(admin, settings_for(None).token, state_dir, stop)
    out.print(f"[bold green]qcluster demo[/]: admin UI at [link={link}]{link}[/link]  "
              + ("(a one-time login: its buttons work; " if link != admin else "(")
              + f"logs in {logs}; Ctrl-C stops)", soft_wrap=True)
    try:
        sent, failed = _feed_load(state_dir, admin, children, duration, stop)
    finally:
        _stop_all(children)
        release(state_dir)
    out.print(f"demo stopped after enqueuing {sent:,} jobs")
    if recording.exists():
        out.print(f"the manager recorded this run in {recording}; replay it with\n"
                  f"  qcluster simulate --trace {recording}", soft_wrap=True)
    if failed is not None:
        raise typer.Exit(1)


def _child_env(state_dir: Path) -> dict[str, str]:
    """The children's environment: the demo's embedded broker, whatever the shell's."""
    env = dict(os.environ, QCLUSTER_STATE_DIR=str(state_dir))
    env.pop("QCLUSTER_BROKER_URL", None)
    return env


def _spawn_cluster(port: int, recording: Path, logs: Path, env: dict[str, str]) -> list[Child]:
    """A manager on ``port`` recording its rounds, and two masters on the ports after it."""
    admin = f"http://127.0.0.1:{port}"
    children = [_spawn("manager", ["manager", "--listen", f"127.0.0.1:{port}", "--interval",
                                   "2", "--record", str(recording)], logs / "manager.log", env)]
    for index, host in enumerate(("demo-a", "demo-b")):
        children.append(_spawn(
            f"master {host}", ["master", "--app", "qcluster.demo.app", "--manager", admin,
                               "--host-name", host, "--listen", f"127.0.0.1:{port + 1 + index}"],
            logs / f"master-{host}.log", env))
    return children


def _feed_load(state_dir: Path, admin: str, children: list[Child], duration: float | None,
               stop: dict[str, bool]) -> tuple[int, Child | None]:
    """Enqueue the demo's load until stopped, ``duration`` is over or a child exits,
    printing a summary every 5 s; the jobs enqueued, and the child that exited."""
    from qcluster.client import Client

    started = time.monotonic()
    sent = 0
    feed = Feed(arrival_rates)
    with Client(f"embedded://{state_dir}") as client:
        next_print = 0.0
        while not stop["now"]:
            t = time.monotonic() - started
            if duration is not None and t >= duration:
                break
            for queue, count in feed.due(t).items():
                client.enqueue_many(queue, [payload(queue, sent + i) for i in range(count)])
                sent += count
            if t >= next_print:
                next_print = t + 5
                for child in children:
                    if why := child.ended():
                        out.print(f"[red]{escape(why)}[/]", soft_wrap=True)
                        return sent, child
                out.print(f"[dim]{t:5.0f}s[/] enqueued {sent:,} | {_summary(admin)}")
            time.sleep(max(0.0, TICK_S - (time.monotonic() - started - t)))
    return sent, None


def _login_link(admin: str, configured: str | None, state_dir: Path,
                stop: dict[str, bool]) -> str:
    """A one-time login to the admin page with the configured token, else the local one the
    manager wrote on its start (``qcluster login`` does the same); the bare URL when the
    manager does not answer within MANAGER_WAIT_S."""
    from qcluster.errors import ConfigError
    from qcluster.local_token import read_local_token

    deadline = time.monotonic() + MANAGER_WAIT_S
    while time.monotonic() < deadline and not stop["now"]:
        try:
            token = configured or read_local_token(state_dir)
            if token is not None and httpx.get(f"{admin}healthz", timeout=2).is_success:
                reply = httpx.post(f"{admin}api/v1/login", timeout=5,
                                   headers={"Authorization": f"Bearer {token}"})
                reply.raise_for_status()
                return f"{admin.rstrip('/')}{reply.json()['path']}"
        except (httpx.HTTPError, ValueError, KeyError, ConfigError):
            pass
        time.sleep(0.2)
    return admin


def _stop_all(children: list[Child]) -> None:
    procs = [child.proc for child in children]
    for proc in reversed(procs):
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
