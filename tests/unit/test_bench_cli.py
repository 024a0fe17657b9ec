"""`python -m bench`'s arguments are read before any broker starts, and the benches that
need no broker (the planner's, the simulator's) start none."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STARTED = "bench brokers:"  # what bench/common.py prints once it started its brokers


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QB_")}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("args", [("--help",), ("--only", "consum")])
def test_help_and_a_mistyped_suite_answer_before_the_brokers_start(args: tuple[str, ...]) -> None:
    done = run("-m", "bench", *args)
    assert STARTED not in done.stdout + done.stderr
    if args == ("--help",):
        assert done.returncode == 0 and "--only" in done.stdout
    else:
        assert done.returncode == 2
        assert "unknown suite consum; choose from consume," in done.stderr


def test_the_planner_and_simulator_benches_start_no_broker() -> None:
    done = run("-c", "import bench.planner_bench, bench.sim_bench")
    assert done.returncode == 0, done.stderr
    assert STARTED not in done.stdout + done.stderr
