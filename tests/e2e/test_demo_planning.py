"""`qcluster demo` for 3 minutes, judged by its own manager: the `resize` queue's plan moves at
most twice per load edge of the demo's square wave (1,500 <-> 50 jobs/s every 40 s) and not
in between, read from the decisions `/api/v1/cluster` reports; and the run's recording
(`--record`) parses as the recorder's format."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from qcluster.demo import RECORDING, RESIZE_EDGE_S
from qcluster.manager.recorder import RecordHeader, RecordRound, read_recording
from tests.brokers import free_port_run
from tests.conftest import QCLUSTER, ROOT, qcluster_env

DEMO_S = 180
MAX_MOVES_PER_EDGE = 2
POLL_S = 3.0
Move = tuple[float, int, int, str]  # (at, from, to, reason)
#: The demo's progress line: "   25s enqueued 31,250 | ..." (t in whole seconds).
PROGRESS = re.compile(r"^\s*(\d+)s enqueued ")


class Demo:
    """The demo as a real process: its console lines with arrival times, its decisions."""

    def __init__(self, state_dir: Path, port: int) -> None:
        self.port = port
        self.lines: list[tuple[float, str]] = []
        self.moves: dict[tuple[float, int, int], Move] = {}
        self.process = subprocess.Popen(
            [*QCLUSTER, "demo", "--duration", str(DEMO_S), "--port", str(port),
             "--state-dir", str(state_dir)],
            cwd=ROOT, env=qcluster_env(PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append((time.time(), line))

    def poll_decisions_until_exit(self) -> int:
        """Collect resize decisions every POLL_S (the ring keeps 500) until the demo exits."""
        url = f"http://127.0.0.1:{self.port}/api/v1/cluster"
        while True:
            try:
                for d in httpx.get(url, timeout=5).json()["decisions"]:
                    if d["queue"] == "resize":
                        self.moves[(d["at"], d["from"], d["to"])] = (
                            d["at"], d["from"], d["to"], d["reason"])
            except (httpx.HTTPError, ValueError, KeyError):
                pass  # starting or stopping
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


@pytest.mark.timeout(DEMO_S + 240)
def test_demo_resize_plan_moves_at_most_twice_per_load_edge(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    demo = Demo(state_dir, free_port_run(3))  # the manager, then one port per master
    try:
        code = demo.poll_decisions_until_exit()
    finally:
        if demo.process.poll() is None:
            demo.process.kill()
    assert code == 0, demo.output
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


def check_recording(recording: Path, output: str) -> None:
    """The run's recording parses as the recorder's format and holds the demo's queues."""
    assert f"qcluster simulate --trace {recording}" in output
    lines = list(read_recording(recording))
    header = lines[0]
    assert isinstance(header, RecordHeader) and {"resize", "mail", "noop"} <= set(header.queues)
    assert [line.type for line in lines].count("header") == 1  # one manager, one header
    rounds = [line for line in lines if isinstance(line, RecordRound)]
    assert len(rounds) >= DEMO_S / 2 / 2  # one per 2 s round, half of them at least
    assert sum(r.queues["resize"].done for r in rounds) > 0
    assert {"demo-a", "demo-b"} <= set(rounds[-1].hosts)
