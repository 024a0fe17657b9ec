"""Real qcluster master/manager processes for end-to-end tests, logging to files."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import time
import urllib.request
from contextlib import suppress
from pathlib import Path
from typing import Any

from tests.conftest import QCLUSTER, ROOT, qcluster_env


class Procs:
    """Starts processes in their own groups; stops every one of them at the end."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.workdir = workdir
        self.env = env
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        log = (self.workdir / f"{name}.log").open("ab")
        proc = subprocess.Popen([*QCLUSTER, *args], cwd=ROOT, env=qcluster_env(**self.env),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.started.append(proc)
        return proc

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop_all(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                with suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in self.started:
            with suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group
            proc.wait()


def get_json(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as response:
        return json.loads(response.read())


def get_text(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as response:
        return str(response.read().decode())


def try_json(port: int, path: str) -> Any:
    try:
        return get_json(port, path)
    except OSError:
        return None


def executed(log_dir: Path) -> collections.Counter[int]:
    """How many times each job number ran, over every slot's log."""
    counts: collections.Counter[int] = collections.Counter()
    for path in log_dir.glob("executed-*.log"):
        counts.update(int(line) for line in path.read_text().split())
    return counts


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().split()[2] != "Z"
    except OSError:
        return False
