"""``python -m bench.metrics_instructions``: what metrics cost a slot, in instructions.

A cross-check of the host suite's CPU-time A/B that the machine's noise cannot move:
valgrind's callgrind counts the instructions a real ``qcluster slot`` executes while it
drains no-op jobs (batch 100) from Redis, with metrics on and off. Each variant runs twice,
with a small and a large queue, and the difference divided by the difference in jobs is
the cost per job without start-up and import. ``PYTHONHASHSEED=0`` keeps dict and set
layouts, and so the counts, the same from run to run. The figure is an upper bound: a slot
under callgrind runs some 50 times slower, so its metric writes, every 0.25 s of wall time,
come some 50 times more often per job than in a real slot (and with small ``--small`` /
``--large`` counts they dominate: use the defaults).

Prints JSON and writes bench/results/metrics_instructions.json. Takes about two minutes
(callgrind runs a program some 50 times slower).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from bench.common import REDIS, ROOT, enqueue_noops, env, python, unique
from qcluster.client import Client

COLLECTED = re.compile(r"Collected : (\d+)")


def instructions(jobs: int, metrics_dir: str | None) -> int:
    """Instructions a slot executes from start to exit draining ``jobs`` no-op jobs."""
    queue = unique("instr")
    with Client(REDIS) as client:
        enqueue_noops(client, queue, jobs)
    extra = {"QB_QUEUE": queue, "QB_BATCH": "100", "PYTHONHASHSEED": "0"}
    if metrics_dir:
        extra["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    try:
        out = subprocess.run(
            ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", python(), "-m",
             "qcluster", "slot", "--app", "bench.apps", "--queue", queue, "--broker", REDIS,
             "--burst", "--log-level", "WARNING"],
            cwd=ROOT, env=env(**extra), capture_output=True, text=True, check=True)
    finally:
        with Client(REDIS) as client:
            client.purge(queue)
    match = COLLECTED.search(out.stderr)
    if match is None:
        raise RuntimeError(f"callgrind printed no instruction count:\n{out.stderr[-2000:]}")
    return int(match.group(1))


def per_job(small: int, large: int, metrics_dir: str | None) -> float:
    return (instructions(large, metrics_dir) - instructions(small, metrics_dir)) / (large - small)


def run(small: int = 2_000, large: int = 12_000) -> dict[str, Any]:
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed (Debian: apt-get install valgrind)")
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="qcluster-bench-instr-", dir=shm) as directory:
        on = per_job(small, large, directory)
    off = per_job(small, large, None)
    results = {"jobs": [small, large], "instructions_per_job_on": round(on),
               "instructions_per_job_off": round(off), "overhead": on / off - 1}
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    (ROOT / "bench" / "results" / "metrics_instructions.json").write_text(
        json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.metrics_instructions")
    parser.add_argument("--small", type=int, default=2_000, help="jobs in the short run")
    parser.add_argument("--large", type=int, default=12_000, help="jobs in the long run")
    options = parser.parse_args()
    print(json.dumps(run(options.small, options.large), indent=2))
