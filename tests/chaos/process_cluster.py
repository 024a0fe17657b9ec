"""The processes of the process-fault rows (tests/chaos/test_process_faults.py): masters and a
manager running ``tests.chaos.process_apps``, each master with a metrics directory of its own
(two masters on one machine must not share one: each clears the other's files at start)
and, for the clock-skew row, an environment of its own; a producer that keeps a steady
rate; a watcher that sees the moment each slot process ends.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import subprocess
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from qcluster import Client
from tests.chaos import process_kills as faults
from tests.chaos.conftest import ChaosRun
from tests.chaos.ledger import LEDGER_ENV, Ledger, Producer
from tests.conftest import free_port, wait_until
from tests.e2e.cluster import Procs, get_json, try_json

APP = "tests.chaos.process_apps"
PREFIX_ENV = "QC_P_PREFIX"


class Hosts:
    """Masters (one session each: the session id is the master's pid) and a manager."""

    def __init__(self, url: str, workdir: Path, prefix: str, env: dict[str, str]) -> None:
        self.url, self.workdir, self.prefix, self.env = url, workdir, prefix, env
        self.all: list[Procs] = []
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ports: dict[str, int] = {}

    @classmethod
    def of(cls, run: ChaosRun) -> Hosts:
        return cls(run.broker.url, run.workdir, run.prefix, dict(run.procs.env))

    def _env(self, name: str, extra: dict[str, str] | None) -> dict[str, str]:
        env = dict(self.env)
        env[PREFIX_ENV] = self.prefix
        env["QCLUSTER_METRICS_DIR"] = str(self.workdir / f"metrics-{name}")
        env.update(extra or {})
        return env

    def _start(self, name: str, args: list[str], env: dict[str, str] | None
               ) -> subprocess.Popen[bytes]:
        procs = Procs(self.workdir, self._env(name, env))
        self.all.append(procs)
        proc = procs.start(name, *args)
        self.procs[name] = proc
        return proc

    def start_master(self, name: str, slots: str | None = None, *, manager: str | None = None,
                     config: Path | None = None, env: dict[str, str] | None = None,
                     wait: bool = True) -> int:
        port = free_port()
        args = ["master", "--app", APP, "--broker", self.url,
                "--listen", f"127.0.0.1:{port}", "--host-name", name]
        if slots:
            args += ["--slots", slots]
        if manager:
            args += ["--manager", manager]
        if config:
            args += ["--config", str(config)]
        self._start(name, args, env)
        self.ports[name] = port
        if wait:
            self.wait_slots_up(name)
        return port

    def wait_slots_up(self, name: str) -> None:
        port, proc = self.ports[name], self.procs[name]

        def up() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"master {name} exited ({proc.returncode}): "
                                     f"{self.log(name)[-2000:]}")
            return _slots_up(port)

        wait_until(up, message=f"master {name}'s slots up")

    def start_manager(self, config: Path, *, interval_s: float = 0.5, port: int | None = None,
                      wait: bool = True) -> int:
        port = port or self.ports.get("manager") or free_port()
        self._start("manager", ["manager", "--config", str(config), "--broker",
                                self.url, "--listen", f"127.0.0.1:{port}",
                                "--interval", str(interval_s)], None)
        self.ports["manager"] = port
        if wait:
            wait_until(lambda: try_json(port, "/healthz"), message="manager answering")
        return port

    def slots(self, name: str) -> list[dict[str, Any]]:
        return list(get_json(self.ports[name], "/api/v1/slots"))

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop_all(self) -> None:
        for procs in self.all:
            procs.stop_all()
        for proc in self.procs.values():  # a master's session: whatever a kill left
            faults.kill_session(proc.pid)


def _slots_up(port: int) -> bool:
    slots = try_json(port, "/api/v1/slots")
    return bool(slots) and all(s["state"] != "starting" for s in slots)


def write_config(path: Path, prefix: str, *, min_flow_slots: int = 2,
                 master_max_slots: int = 256) -> Path:
    """Manager and masters: fast reports and rounds; only the flow queue is planned."""
    path.write_text(f"""
[master]
report_interval_s = 0.5
max_slots = {master_max_slots}

[manager]
window_s = 10.0

[queues.{prefix}-flow]
min_slots = {min_flow_slots}
max_slots = 4

[queues.{prefix}-hang]
max_slots = 0

[queues.{prefix}-hog]
max_slots = 0
""")
    return path


class SteadyProducer(threading.Thread):
    """Enqueues ``rate`` jobs per second to ``queue`` on a schedule (behind it catches up,
    so the offered load stays the rate however the CPU is shared), through a client of
    its own; enqueue errors are recorded in the ledger and do not stop it."""

    def __init__(self, url: str, ledger_dir: Path, *, seed: int, queue: str, rate: float,
                 fields: dict[str, Any] | None = None, step_s: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.url, self.ledger_dir, self.seed = url, ledger_dir, seed
        self.queue, self.rate, self.step_s = queue, rate, step_s
        self.fields = fields or {}
        self.stopped = threading.Event()
        self.sent = 0
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            with Client(self.url) as client:
                producer = Producer(client, self.ledger_dir, seed=self.seed, tag="p")
                began = time.monotonic()
                while not self.stopped.is_set():
                    due = int(self.rate * (time.monotonic() - began)) - self.sent
                    if due > 0:
                        producer.enqueue(self.queue, due, fields=self.fields,
                                         raise_errors=False)
                        self.sent += due
                    self.stopped.wait(self.step_s)
        except BaseException as exc:  # reported by stop()
            self.failure = exc

    def stop(self) -> int:
        self.stopped.set()
        self.join(timeout=60)
        if self.failure is not None:
            raise AssertionError(f"the producer failed: {self.failure!r}")
        return self.sent


class SlotWatch(threading.Thread):
    """Follows a master's slots (its API, every 50 ms) and holds a pidfd on each, so the
    moment each one ends is seen by the kernel's wake-up, not by polling: ``ended[pid]``
    is the monotonic time it was seen gone. A slot already gone when first seen (the test
    was descheduled for its whole life) is in ``missed``."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.ended: dict[int, float] = {}
        self.missed: set[int] = set()
        self._fds: dict[int, int] = {}
        self._done = threading.Event()

    def run(self) -> None:
        poller = select.poll()
        by_fd: dict[int, int] = {}
        while not self._done.is_set():
            for slot in try_json(self.port, "/api/v1/slots") or []:
                pid = int(slot.get("pid") or 0)
                if not pid or pid in self._fds or pid in self.ended or pid in self.missed:
                    continue
                try:
                    fd = os.pidfd_open(pid)
                except ProcessLookupError:
                    self.missed.add(pid)
                    continue
                self._fds[pid], by_fd[fd] = fd, pid
                poller.register(fd, select.POLLIN)
            for fd, _ in poller.poll(50):
                pid = by_fd.pop(fd)
                self.ended[pid] = time.monotonic()
                poller.unregister(fd)
                os.close(self._fds.pop(pid))
        for fd in self._fds.values():
            os.close(fd)

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=10)


def runs_by_id(ledger: Ledger) -> dict[str, list[dict[str, Any]]]:
    """Every execution of each job, from the raw lines: pid, attempt, start, end (finish or
    abort, None if interrupted) and its last sign of life (its latest line of any kind)."""
    executions: dict[tuple[str, int, int], dict[str, Any]] = {}
    for line in sorted(ledger.lines, key=lambda line: float(line["m"])):
        if line["e"] in ("attempt", "ack", "error"):
            continue
        key = (str(line["id"]), int(line.get("a", 0)), int(line.get("pid", 0)))
        if line["e"] == "start":
            executions[key] = {"id": key[0], "attempt": key[1], "pid": key[2],
                               "start": float(line["m"]), "end": None, "last": float(line["m"])}
            continue
        run = executions.get(key)
        if run is None:
            continue
        run["last"] = max(run["last"], float(line["m"]))
        if line["e"] in ("finish", "abort"):
            run["end"] = float(line["m"])
    grouped: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for run in executions.values():
        grouped[run["id"]].append(run)
    for runs in grouped.values():
        runs.sort(key=lambda run: run["start"])
    return grouped


def overlaps(ledger: Ledger) -> dict[str, float]:
    """Jobs that ran in two processes at once: an execution started before an earlier
    execution of the same job showed its last sign of life (its finish, or its last line
    if it was interrupted). Job id -> seconds of overlap."""
    found: dict[str, float] = {}
    for job_id, runs in runs_by_id(ledger).items():
        for earlier, later in itertools.pairwise(runs):
            if later["start"] < earlier["last"]:
                found[job_id] = round(earlier["last"] - later["start"], 4)
    return found


def signal_master(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, sig)


def orphans_after(sid: int, timeout_s: float) -> tuple[list[int], float]:
    """Wait up to ``timeout_s`` for the session to be empty; (what is left, seconds taken)."""
    began = time.monotonic()
    while True:
        left = faults.session_members(sid)
        waited = time.monotonic() - began
        if not left or waited >= timeout_s:
            return left, waited
        time.sleep(0.02)


def ledger_dir_of(run: ChaosRun) -> Path:
    return Path(run.procs.env[LEDGER_ENV])

