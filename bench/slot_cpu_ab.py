"""A slot's CPU per job under a real master, two source trees side by side.

    python -m bench.slot_cpu_ab BEFORE_TREE [AFTER_TREE] [--rounds N]

e.g. ``git worktree add /tmp/before <commit>; python -m bench.slot_cpu_ab /tmp/before``.
Each round starts one ``qcluster master --slots Q=1`` per tree at the same time, each on a
queue of its own filled with no-op jobs (private Redis, batch 100 then batch 1), pins both
slots to one core, and reads each slot's CPU (/proc/PID/schedstat) from its first job gone
to its queue empty. Side by side, both see the same machine: a loaded 2-core host drifts by
more than the few percent a change to the slot's loop costs. This is the figure a change to
the followed take (the master's give-back, issue 16) is judged by: `qcluster slot` alone,
which the consume suite runs, has no master and follows nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

from bench.common import REDIS, ROOT, enqueue_noops, free_listen, python, unique
from qcluster.client import Client

#: (batch size, jobs per queue and round)
RUNS = ((100, 200_000), (1, 40_000))
DEADLINE_S = 300.0


def _slot_cpu_s(slot: psutil.Process) -> float:
    with open(f"/proc/{slot.pid}/schedstat") as stat:
        return int(stat.read().split()[0]) / 1e9


def _start_masters(trees: dict[str, Path], queues: dict[str, str],
                   batch: int) -> dict[str, subprocess.Popen[bytes]]:
    procs = {}
    for name, tree in trees.items():
        env = dict(os.environ, PYTHONPATH=str(tree), QB_QUEUE=queues[name], QB_BATCH=str(batch),
                   QCLUSTER_METRICS_DIR=tempfile.mkdtemp(prefix="qc-ab-", dir="/dev/shm"))
        procs[name] = subprocess.Popen(
            [python(), "-m", "qcluster", "master", "--app", "bench.apps", "--broker", REDIS,
             "--slots", f"{queues[name]}=1", "--listen", free_listen(), "--log-level",
             "WARNING"], cwd=tree, env=env, start_new_session=True,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return procs


def one_round(trees: dict[str, Path], batch: int, jobs: int) -> dict[str, float]:
    """Microseconds of slot CPU per job for each tree, measured side by side."""
    queues = {name: unique(f"ab-{name}") for name in trees}
    with Client(REDIS) as client:
        for queue in queues.values():
            enqueue_noops(client, queue, jobs)
        procs = _start_masters(trees, queues, batch)
        try:
            return _cpu_per_job(client, queues, procs, jobs)
        finally:
            for proc in procs.values():
                os.killpg(proc.pid, 15)
                proc.wait(30)
            for queue in queues.values():
                client.purge(queue)


def _cpu_per_job(client: Client, queues: dict[str, str],
                 procs: dict[str, subprocess.Popen[bytes]], jobs: int) -> dict[str, float]:
    core = max(os.sched_getaffinity(0))
    slots: dict[str, psutil.Process] = {}
    started: dict[str, tuple[float, int]] = {}
    result: dict[str, float] = {}
    deadline = time.monotonic() + DEADLINE_S
    while len(result) < len(queues):
        if time.monotonic() > deadline:
            raise SystemExit(f"slot_cpu_ab: queues not drained in {DEADLINE_S:g} s: {result}")
        for name, queue in queues.items():
            if name in result:
                continue
            if name not in slots:
                children = psutil.Process(procs[name].pid).children()
                if not children:
                    continue
                slots[name] = children[0]
                slots[name].cpu_affinity([core])
            ready = client.stats(queue)["ready"]
            try:
                if name not in started:
                    if ready < jobs:
                        started[name] = (_slot_cpu_s(slots[name]), ready)
                elif ready == 0:
                    cpu_start, left = started[name]
                    result[name] = (_slot_cpu_s(slots[name]) - cpu_start) / left * 1e6
            except FileNotFoundError:  # a short-lived child, not the slot: measure again
                del slots[name]
                started.pop(name, None)
        time.sleep(0.005)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path, nargs="?", default=ROOT)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    for batch, jobs in RUNS:
        ratios = []
        for round_no in range(args.rounds):
            cpu = one_round(trees, batch, jobs)
            ratios.append(cpu["after"] / cpu["before"])
            print(json.dumps({"batch": batch, "round": round_no,
                              **{k: round(v, 2) for k, v in cpu.items()}}), flush=True)
        print(f"batch {batch}: after / before slot CPU per job, median of {args.rounds}: "
              f"{statistics.median(ratios):.3f}", flush=True)


if __name__ == "__main__":
    main()
