"""`qcluster demo` (what `make demo` runs) as a real process for two minutes of load, then
Ctrl-C, started outside the repository with nothing of it importable but the installed
qcluster (as a user of the package runs it): it runs a cluster of two masters, stops
cleanly and leaves no process behind; judged
by its own manager, the `resize` queue's plan moves at most twice per load edge of the demo's
square wave (1,500 <-> 50 jobs/s every 40 s: up at 0 s, down at 40 s, up at 80 s) and not in
between, read from the decisions `/api/v1/cluster` reports; and the run's recording parses as
the recorder's format."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from qcluster import exitcodes
from qcluster.demo import RECORDING, RESIZE_EDGE_S
from qcluster.manager.planning.recorder import RecordHeader, RecordRound, read_recording
from tests.brokers import free_port_run
from tests.conftest import QCLUSTER, qcluster_env
from tests.e2e.test_one_broker import processes_under

#: Seconds of load before the test's Ctrl-C: three half-periods of the square wave.
LOAD_S = 3 * RESIZE_EDGE_S
MAX_MOVES_PER_EDGE = 2
POLL_S = 3.0
Move = tuple[float, int, int, str]  # (at, from, to, reason)
#: The demo's progress line: "   25s enqueued 31,250 | ..." (t in whole seconds).
PROGRESS = re.compile(r"^\s*(\d+)s enqueued ")


class Demo:
    """The demo as a real process: its console lines with arrival times, its decisions."""

    def __init__(self, state_dir: Path, port: int, cwd: Path) -> None:
        self.port = port
        self.lines: list[tuple[float, str]] = []
        self.moves: dict[tuple[float, int, int], Move] = {}
        self.process = subprocess.Popen(
            [*QCLUSTER, "demo", "--port", str(port), "--state-dir", str(state_dir)],
            cwd=cwd, env=qcluster_env(PYTHONUNBUFFERED="1", PYTHONPATH=""), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.interrupted = False

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append((time.time(), line))

    def load_seconds(self) -> int:
        """The load generator's own ``t`` on its latest progress line."""
        found = [PROGRESS.match(line) for _, line in self.lines]
        return max((int(m.group(1)) for m in found if m), default=0)

    def poll_decisions_until_exit(self) -> int:
        """Collect resize decisions every POLL_S (the ring keeps 500); after LOAD_S seconds
        of load, Ctrl-C (SIGINT to the demo, as a terminal sends it); until the demo exits."""
        url = f"http://127.0.0.1:{self.port}/api/v1/cluster"
        while True:
            try:
                for d in httpx.get(url, timeout=5).json()["decisions"]:
                    if d["queue"] == "resize":
                        self.moves[(d["at"], d["from"], d["to"])] = (
                            d["at"], d["from"], d["to"], d["reason"])
            except (httpx.HTTPError, ValueError, KeyError):
                pass  # starting or stopping
            if not self.interrupted and self.load_seconds() >= LOAD_S:
                self.process.send_signal(signal.SIGINT)
                self.interrupted = True
            try:
                code = self.process.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                continue
            self.reader.join(timeout=30)
            return code

    def load_started_at(self) -> float:
        """Wall time the load generator started, at the latest: the banner is printed just
        before it starts, and each progress line says the generator's own ``t`` (rounded
        to the second). A line is read some time after it was printed (more on a loaded
        machine, where the reader thread waits for a core), so every line gives a bound
        from above and the tightest one wins: the edges are not placed late, which would
        count the moves right after an edge against the one before."""
        bounds = [at for at, line in self.lines if "qcluster demo" in line]
        for at, line in self.lines:
            found = PROGRESS.match(line)
            if found:
                bounds.append(at - int(found.group(1)) + 0.5)
        return min(bounds)

    @property
    def output(self) -> str:
        return "".join(line for _, line in self.lines)


def moves_per_half_period(moves: list[Move], started_at: float) -> Counter[int]:
    """Half-period k is [k * 40 s, (k + 1) * 40 s) of the demo: it starts at a load edge."""
    return Counter(int((at - started_at) // RESIZE_EDGE_S) for at, *_ in moves)


def table(moves: list[Move], started_at: float) -> str:
    rows = [f"{'t (s)':>7} {'edge':>5} {'move':>9}  reason"]
    for at, before, after, reason in moves:
        t = at - started_at
        edge = int(t // RESIZE_EDGE_S) * RESIZE_EDGE_S
        rows.append(f"{t:7.1f} {edge:5.0f} {f'{before} -> {after}':>9}  {reason}")
    return "\n".join(rows)


@pytest.mark.timeout(LOAD_S + 240)
def test_demo_runs_stops_on_ctrl_c_and_moves_resize_at_most_twice_per_load_edge(
    tmp_path: Path,
) -> None:
    state_dir = tmp_path / "state"
    port = free_port_run(3)  # the manager, then one port per master
    demo = Demo(state_dir, port, cwd=tmp_path)
    try:
        code = demo.poll_decisions_until_exit()
    finally:
        stop_leftovers(demo.process, tmp_path)
    assert code == 0, demo.output
    assert demo.interrupted, f"the demo ended before the test's Ctrl-C:\n{demo.output}"
    assert " exited (code " not in demo.output, demo.output
    check_clean_run(demo.output, port, tmp_path)
    check_recording(state_dir / RECORDING, demo.output)
    started_at = demo.load_started_at()
    moves = sorted(demo.moves.values())
    seen = table(moves, started_at)
    print(f"\nresize plan moves, t from the start of the load (edges every {RESIZE_EDGE_S:g} s):"
          f"\n{seen}")
    assert moves, f"the manager never planned resize:\n{demo.output}"
    per_edge = moves_per_half_period(moves, started_at)
    over = {k * RESIZE_EDGE_S: n for k, n in per_edge.items() if n > MAX_MOVES_PER_EDGE}
    assert not over, f"more than {MAX_MOVES_PER_EDGE} moves after edge(s) {over}:\n{seen}"


def stop_leftovers(process: subprocess.Popen[str], tmp_path: Path) -> None:
    """After a failure: Ctrl-C, so the demo stops its children (each in its own session);
    then whatever still runs under the test's directory is killed."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
    for found in processes_under(tmp_path):  # "PID: command line (cwd ...)"
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(found.split(":", 1)[0]), signal.SIGKILL)


def check_clean_run(output: str, port: int, tmp_path: Path) -> None:
    """What a user of `make demo` sees, and nothing left running after Ctrl-C."""
    assert f"http://127.0.0.1:{port}/" in output
    assert f"http://127.0.0.1:{port}/login?code=" in output  # its buttons work (one-time login)
    assert "hosts 2" in output  # both masters reported to the manager
    assert re.search(r"[1-9]\d*/\d+\s+slots", output), output  # slots ran
    assert "demo stopped after enqueuing" in output
    leftovers = subprocess.run(["pgrep", "-f", f"127.0.0.1:{port}"], capture_output=True)
    assert leftovers.stdout == b"", "a demo process outlived the demo"
    # nor its embedded broker: no process left whose command line names its state directory
    assert processes_under(tmp_path) == []


def check_recording(recording: Path, output: str) -> None:
    """The run's recording parses as the recorder's format and holds the demo's queues."""
    assert f"qcluster simulate --trace {recording}" in output
    lines = list(read_recording(recording))
    header = lines[0]
    assert isinstance(header, RecordHeader) and {"resize", "mail", "noop"} <= set(header.queues)
    assert [line.type for line in lines].count("header") == 1  # one manager, one header
    rounds = [line for line in lines if isinstance(line, RecordRound)]
    assert len(rounds) >= LOAD_S / 2 / 2  # one per 2 s round, half of them at least
    assert sum(r.queues["resize"].done for r in rounds) > 0
    assert {"demo-a", "demo-b"} <= set(rounds[-1].hosts)


def test_a_demo_whose_ports_are_taken_says_which_in_one_line_and_starts_nothing(
    tmp_path: Path,
) -> None:
    port = free_port_run(3)
    state_dir = tmp_path / "state"
    with socket.socket() as holder:  # the second master's port, held by another process
        holder.bind(("127.0.0.1", port + 2))
        holder.listen()
        result = subprocess.run(
            [*QCLUSTER, "demo", "--port", str(port), "--duration", "5", "--state-dir",
             str(state_dir)], cwd=tmp_path, env=qcluster_env(), capture_output=True, text=True,
            timeout=60)
    assert result.returncode == exitcodes.ADDRESS_IN_USE, result.stdout + result.stderr
    assert result.stderr.strip() == (f"error: 127.0.0.1:{port + 2} is already in use (another "
                                     "qcluster process?): choose another port with --port")
    assert not state_dir.exists()  # no broker, manager or master was started
