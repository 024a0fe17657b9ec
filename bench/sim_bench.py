"""The simulator at the seed's scale: a 24 h trace of 150 queues on 40 hosts
(examples/traces/large_150x40.json, planned every 10 s) with the manager's real planner,
on one core. ``python -m bench.sim_bench`` prints JSON, writes bench/results/simulator.json.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from qcluster.manager.simulator import load_trace, simulate
from qcluster.manager.simulator.figures import figures

#: Not bench.common's: importing it starts the suites' brokers, which this one needs not.
ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "examples" / "traces" / "large_150x40.json"
TARGET_S = 60.0


def run() -> dict[str, Any]:
    trace = load_trace(TRACE)
    started_cpu, started = time.process_time(), time.perf_counter()
    result = simulate(trace, ("qcluster",), seed=0)
    cpu_s, wall_s = time.process_time() - started_cpu, time.perf_counter() - started
    overall = figures(result)["policies"]["qcluster"]["overall"]
    out = {"trace": TRACE.name, "simulated_s": trace.duration_s, "queues": len(trace.queues),
           "hosts": len(trace.hosts), "interval_s": trace.interval_s,
           "rounds": round(trace.duration_s / trace.interval_s), "jobs": overall["jobs"],
           "cpu_s": round(cpu_s, 1), "wall_s": round(wall_s, 1), "target_s": TARGET_S}
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    (ROOT / "bench" / "results" / "simulator.json").write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
