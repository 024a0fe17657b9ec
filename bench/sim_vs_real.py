"""The simulator against the real cluster, on the same load.

``qcluster demo`` runs a real cluster for ``DEMO_S`` seconds (the embedded broker, a
manager recording the run with ``--record``, two masters forking real slots, a load that
changes: ``resize`` a square wave of 1,500 <-> 50 jobs/s every 40 s, ``mail`` a sine,
``noop`` a burst every 45 s). Its recording is replayed in the simulator with the
manager's planner (``qcluster simulate --trace RECORDING``), and each queue is compared:

* slot-seconds: the slots running at each round times the interval (real), the slots
  alive (simulated);
* slot moves: the changes of the running slots from round to round (real; a start and a
  stop within one round are not seen), slot starts + stops (simulated);
* mean wait, by Little's law: the mean ready backlog at the rounds over the arrival rate
  (the recording has no per-job waits; both sides are estimated the same way);
* peak backlog at a round.

``python -m bench.sim_vs_real`` prints JSON and writes bench/results/sim_vs_real.json.
The error (simulated / real - 1) is in docs/simulator.md.
"""

from __future__ import annotations

import itertools
import json
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qcluster.demo import RECORDING
from qcluster.manager.recorder import RecordRound, read_recording
from qcluster.manager.simulator import load_trace, simulate

ROOT = Path(__file__).resolve().parents[1]
DEMO_S = 160
#: The error the comparison is judged on (slot-seconds and waits within 20%, moves 30%).
TARGETS = {"slot_seconds": 0.2, "mean_wait_s": 0.2, "slot_moves": 0.3}


def free_ports(count: int) -> int:
    """A base port with ``count`` free ports after it (the demo takes base, base+1, ...)."""
    for _ in range(200):
        base = random.randint(20_000, 60_000)
        try:
            for port in range(base, base + count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free ports")


def run_demo(state_dir: Path, seconds: int) -> Path:
    """The demo as a real process for ``seconds``; returns its recording."""
    command = [sys.executable, "-m", "qcluster", "demo", "--duration", str(seconds), "--port",
               str(free_ports(3)), "--state-dir", str(state_dir)]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.STDOUT, timeout=seconds + 180)
    return state_dir / RECORDING


def real_figures(recording: Path) -> dict[str, dict[str, float]]:
    rounds = [line for line in read_recording(recording) if isinstance(line, RecordRound)]
    header = next(iter(read_recording(recording)))
    interval = float(header.interval_s)  # type: ignore[union-attr]
    out: dict[str, dict[str, float]] = {}
    for name in sorted({q for r in rounds for q in r.queues}):
        slots = [r.queues[name].slots if name in r.queues else 0 for r in rounds]
        backlog = [r.queues[name].backlog if name in r.queues else 0 for r in rounds]
        arrived = sum(r.queues[name].arrived for r in rounds if name in r.queues)
        out[name] = figures_of(slots, backlog, arrived, interval, len(rounds) * interval)
        out[name]["slot_moves"] = sum(abs(b - a) for a, b in itertools.pairwise(slots))
    return out


def figures_of(slots: Sequence[float], backlog: Sequence[int], arrived: int, interval: float,
               duration: float) -> dict[str, float]:
    rate = arrived / duration if duration else 0.0
    mean_backlog = sum(backlog) / len(backlog) if backlog else 0.0
    return {"slot_seconds": round(sum(slots) * interval, 1), "jobs": arrived,
            "mean_wait_s": round(mean_backlog / rate, 3) if rate else 0.0,
            "max_backlog": max(backlog, default=0)}


def simulated_figures(recording: Path) -> dict[str, dict[str, float]]:
    trace = load_trace(recording)
    run = simulate(trace, ("qcluster",), seed=0).runs["qcluster"]
    out = {}
    for name, q in run.queues.items():
        series = q.series
        fig = figures_of([], series.backlog, q.arrived, trace.interval_s, trace.duration_s)
        fig["slot_seconds"] = round(q.slot_seconds, 1)
        fig["slot_moves"] = q.starts + q.stops
        out[name] = fig
    return out


def compare(real: dict[str, dict[str, float]],
            sim: dict[str, dict[str, float]]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for name in sorted(real):
        errors = {}
        for key in ("slot_seconds", "slot_moves", "mean_wait_s", "max_backlog"):
            a, b = real[name][key], sim.get(name, {}).get(key, 0.0)
            errors[key] = round(b / a - 1, 3) if a else None
        rows[name] = {"real": real[name], "simulated": sim.get(name, {}), "error": errors}
    return rows


def run(seconds: int = DEMO_S) -> dict[str, Any]:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="qc-sim-vs-real-") as tmp:
        recording = run_demo(Path(tmp) / "state", seconds)
        real, sim = real_figures(recording), simulated_figures(recording)
    rows = compare(real, sim)
    within = {name: {key: row["error"][key] is not None and abs(row["error"][key]) <= limit
                     for key, limit in TARGETS.items()} for name, row in rows.items()}
    out = {"demo_s": seconds, "queues": rows, "targets": TARGETS, "within": within,
           "wall_s": round(time.perf_counter() - started, 1)}
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    (ROOT / "bench" / "results" / "sim_vs_real.json").write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    print(json.dumps(run(int(sys.argv[1]) if len(sys.argv) > 1 else DEMO_S), indent=2))
