"""The simulator against the real cluster, on the same load.

``qcluster demo`` runs a real cluster for ``DEMO_S`` seconds (the embedded broker, a
manager recording the run with ``--record``, two masters forking real slots, a load that
changes: ``resize`` a square wave of 1,500 <-> 50 jobs/s every 40 s, ``mail`` a sine,
``noop`` a burst every 45 s). Its recording is replayed in the simulator with the
manager's planner (``qcluster simulate --trace RECORDING``), and each queue is compared:

Both sides are measured the same way, from samples at the manager's rounds (the
recording has nothing finer): per round the running slots (the masters' latest report:
forked, started or starting), the ready backlog and the jobs arrived since the round
before. From them, per queue:

* slot-seconds: the running slots at each round times the interval;
* slot moves: the changes of the running slots from round to round (a start and a stop
  within one round are not seen, on either side);
* waits, first in first out, from the cumulative curves: the jobs arrived by each round
  (spread evenly within it) against the jobs taken by each round (arrived less ready); a
  job's wait is the time between the two curves at its number. p99, p50 and the mean
  (the mean is Little's law on the same curves);
* slots over time: the mean gap between the two slot counts at a round, over the mean;
* peak backlog at a round.

The simulation's own figures (per job, every slot start and stop) are kept beside them
(``own``), which shows what the round sampling misses.

``python -m bench.sim_vs_real`` prints JSON and writes bench/results/sim_vs_real.json
(the load average while the demo ran in it) and keeps the recording beside it;
``--replay FILE`` compares a kept recording again, without a demo, and only prints;
``--fit`` replays it with its cost per batch fitted, not measured (its slots' batch
seconds dropped), as a recording written before them.
The error (simulated / real - 1) is in docs/simulator.md.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qcluster.demo import RECORDING
from qcluster.manager.planning.recorder import RecordRound, read_recording
from qcluster.manager.simulator import load_trace
from qcluster.manager.simulator.engine import Simulation
from qcluster.manager.simulator.model import QueueSim
from qcluster.manager.simulator.policies import make_policy

ROOT = Path(__file__).resolve().parents[1]
DEMO_S = 160
#: The error the comparison is judged on (slot-seconds and waits within 20%, moves 30%).
TARGETS = {"slot_seconds": 0.2, "p99_wait_s": 0.2, "slot_moves": 0.3}


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


class Rounds:
    """A queue as the rounds sample it: at each round the running slots (forked, started or
    starting), the ready backlog and the jobs arrived since the round before."""

    def __init__(self) -> None:
        self.slots: list[int] = []
        self.backlog: list[int] = []
        self.arrived: list[int] = []

    def add(self, slots: int, backlog: int, arrived: int) -> None:
        self.slots.append(slots)
        self.backlog.append(backlog)
        self.arrived.append(arrived)


def real_rounds(recording: Path) -> tuple[dict[str, Rounds], float]:
    lines = list(read_recording(recording))
    interval = float(lines[0].interval_s)  # type: ignore[union-attr]
    rounds = [line for line in lines if isinstance(line, RecordRound)]
    out: dict[str, Rounds] = {}
    for name in sorted({q for r in rounds for q in r.queues}):
        seen = out[name] = Rounds()
        for r in rounds:
            q = r.queues.get(name)
            seen.add(q.slots, q.backlog, q.arrived) if q else seen.add(0, 0, 0)
    return out, interval


class SampledSimulation(Simulation):
    """The simulation, sampled as the recording samples the cluster. Round k of the replay
    carries the arrivals the recording's round k counted (those of the interval before
    it), so its end is that round's moment: the backlog and the arrivals are taken there.
    The recording's slots are the masters' latest report, sent ``report_lag_s`` before the
    round in the model: the running slots are taken at that step, before the hosts act on
    a new plan (which a master gets in the response to that report)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.sampled = {name: Rounds() for name in self.queues}
        self.arrived_before = dict.fromkeys(self.queues, 0)
        self.reported = dict.fromkeys(self.queues, 0)
        self.report_step = (self.steps - round(self.trace.report_lag_s / self.dt)) % self.steps

    def assign(self, now: float) -> None:
        if round((now % self.trace.interval_s) / self.dt) % self.steps == self.report_step:
            for name, q in self.queues.items():
                self.reported[name] = q.active + q.starting
        super().assign(now)

    def end_round(self, q: QueueSim, index: int, now: float) -> None:
        super().end_round(q, index, now)
        self.sampled[q.name].add(self.reported[q.name], q.backlog,
                                 q.arrived - self.arrived_before[q.name])
        self.arrived_before[q.name] = q.arrived


def fifo_waits(rounds: Rounds, interval: float, points: int = 20_000) -> list[float]:
    """Each job's wait, first in first out, from the rounds alone: the jobs arrived by
    each round (spread evenly within it) against the jobs taken by each round (arrived
    less ready; kept from falling), the time between the x-th arrival and the x-th take
    (to the end for a job never taken). ``points`` jobs evenly spaced stand for all."""
    arrived = list(itertools.accumulate(rounds.arrived))
    total = arrived[-1] if arrived else 0
    if not total:
        return []
    taken = list(itertools.accumulate(
        (a - b for a, b in zip(arrived, rounds.backlog, strict=True)), max))
    times = [(k + 1) * interval for k in range(len(arrived))]
    end = times[-1]

    def at(cumulative: list[int], x: float) -> float:
        """When the curve (0 at time 0, linear between rounds) first reaches ``x``."""
        k = bisect.bisect_left(cumulative, x)
        if k == len(cumulative):
            return end
        before, when_before = (cumulative[k - 1], times[k - 1]) if k else (0, 0.0)
        if cumulative[k] == before:
            return times[k]
        return when_before + (x - before) / (cumulative[k] - before) * interval

    step = total / min(points, total)
    return [max(0.0, at(taken, x) - at(arrived, x))
            for x in (step * (i + 0.5) for i in range(min(points, total)))]


def figures_of(rounds: Rounds, interval: float) -> dict[str, Any]:
    """A queue's figures from its round samples, measured the same way on both sides."""
    waits = sorted(fifo_waits(rounds, interval))

    def quantile(share: float) -> float:
        return round(waits[min(len(waits) - 1, int(share * len(waits)))], 3) if waits else 0.0

    return {"slot_seconds": round(sum(rounds.slots) * interval, 1),
            "slot_moves": sum(abs(b - a) for a, b in itertools.pairwise(rounds.slots)),
            "jobs": sum(rounds.arrived),
            "p99_wait_s": quantile(0.99), "p50_wait_s": quantile(0.5),
            "mean_wait_s": round(sum(waits) / len(waits), 3) if waits else 0.0,
            "max_backlog": max(rounds.backlog, default=0),
            "slots": rounds.slots}


def real_figures(recording: Path) -> dict[str, dict[str, Any]]:
    rounds, interval = real_rounds(recording)
    return {name: figures_of(seen, interval) for name, seen in rounds.items()}


def without_measured_costs(recording: Path, into: Path) -> Path:
    """The recording without the slots' batch seconds (``batches``, ``batch_s``): replayed,
    its cost per batch is fitted as for a recording written before them."""
    lines = []
    for text in recording.read_text().splitlines():
        line = json.loads(text)
        for queue in line.get("queues", {}).values() if line.get("type") == "round" else ():
            queue.pop("batches", None)
            queue.pop("batch_s", None)
        lines.append(json.dumps(line))
    into.write_text("\n".join(lines) + "\n")
    return into


def simulated_figures(recording: Path) -> dict[str, dict[str, Any]]:
    trace = load_trace(recording)
    sim = SampledSimulation(trace, make_policy("qcluster", trace), 0)
    run = sim.run()
    out = {}
    for name, q in run.queues.items():
        fig = figures_of(sim.sampled[name], trace.interval_s)
        # The simulation's own figures, per job and per slot start, beside the sampled ones.
        waits = sorted(q.waits.elements())
        fig["own"] = {"slot_seconds": round(q.slot_seconds, 1), "slot_moves": q.starts + q.stops,
                      "p99_wait_s": round(waits[int(0.99 * (len(waits) - 1))] * run.step_s, 3)
                      if waits else 0.0, "batch_cost_s": trace.queues[name].batch_cost_s}
        out[name] = fig
    return out


def compare(real: dict[str, dict[str, Any]], sim: dict[str, dict[str, Any]]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for name in sorted(real):
        mine = sim.get(name, {})
        errors = {}
        for key in ("slot_seconds", "slot_moves", "p99_wait_s", "mean_wait_s", "max_backlog"):
            a, b = real[name][key], mine.get(key, 0.0)
            errors[key] = round(b / a - 1, 3) if a else None
        ours, theirs = mine.get("slots", []), real[name]["slots"]
        paired = list(zip(theirs, ours, strict=False))
        mean = sum(theirs) / len(theirs) if theirs else 0.0
        # Slots over time: the mean gap between the two at a round, over the mean slots.
        errors["slots_gap"] = (round(sum(abs(a - b) for a, b in paired) / len(paired) / mean, 3)
                               if paired and mean else None)
        rows[name] = {"real": real[name], "simulated": mine, "error": errors}
    return rows


def is_within(row: dict[str, Any], key: str, limit: float) -> bool:
    """The relative error within ``limit``; a figure that is 0 on both sides agrees
    (its relative error is undefined: ``None``)."""
    if row["error"][key] is None:
        return row["simulated"].get(key, 0.0) == row["real"][key] == 0
    return abs(row["error"][key]) <= limit


#: The latest run's recording, kept: ``--replay`` compares it again without a demo.
KEPT = ROOT / "bench" / "results" / "sim_vs_real_recording.jsonl"


def run(seconds: int = DEMO_S, replay: Path | None = None, fit: bool = False) -> dict[str, Any]:
    started = time.perf_counter()
    loads: list[float] = []
    stop = threading.Event()

    def sample_load() -> None:  # the machine's 1-minute load average while the demo runs
        while not stop.wait(5.0):
            loads.append(os.getloadavg()[0])

    sampler = threading.Thread(target=sample_load, daemon=True)
    sampler.start()
    with tempfile.TemporaryDirectory(prefix="qc-sim-vs-real-") as tmp:
        if replay is None:
            recording = run_demo(Path(tmp) / "state", seconds)
            KEPT.parent.mkdir(exist_ok=True)
            shutil.copyfile(recording, KEPT)
        else:
            recording = replay
        if fit:
            recording = without_measured_costs(recording, Path(tmp) / "fitted.jsonl")
        real, sim = real_figures(recording), simulated_figures(recording)
    stop.set()
    sampler.join()
    load = {"min": min(loads, default=0.0), "mean": sum(loads) / len(loads) if loads else 0.0,
            "max": max(loads, default=0.0)}
    rows = compare(real, sim)
    within = {name: {key: is_within(row, key, limit) for key, limit in TARGETS.items()}
              for name, row in rows.items()}
    out = {"demo_s": seconds, "load_average": {k: round(v, 2) for k, v in load.items()},
           "queues": rows,
           "targets": TARGETS, "within": within, "wall_s": round(time.perf_counter() - started, 1)}
    if replay is None:  # (a replay has no demo's load or time: it only prints)
        (ROOT / "bench" / "results").mkdir(exist_ok=True)
        (ROOT / "bench" / "results" / "sim_vs_real.json").write_text(json.dumps(out, indent=2))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("seconds", nargs="?", type=int, default=DEMO_S)
    parser.add_argument("--replay", type=Path, help="compare this recording, no demo")
    parser.add_argument("--fit", action="store_true",
                        help="fit the cost per batch as for a recording without the slots' "
                             "batch seconds (the model before they were recorded)")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.seconds, args.replay, args.fit), indent=2))


if __name__ == "__main__":
    main()
