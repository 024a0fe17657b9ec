"""``python -m bench.metrics_cost``: microseconds a slot spends recording the metrics of one
job (a batch of 100 through the real ``_SlotMetrics.observe``, prometheus_client in the
multiprocess mode slots run in). Prints one number. Run as its own process: the mode is
chosen when prometheus_client is first imported."""

from __future__ import annotations

import os
import tempfile
import timeit
from types import SimpleNamespace

BATCH = 100


def main() -> None:
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = d
        from slot.runtime import _SlotMetrics

        recorder = _SlotMetrics("slot1")
        jobs = [SimpleNamespace(delivery=SimpleNamespace(taken_at=1000.0),
                                activate_at=999.99 - n * 1e-5, outcome="done", error="")
                for n in range(BATCH)]
        counters = SimpleNamespace(done=BATCH, retried=0, failed=0, malformed=0, busy_s=3e-4)
        rounds = 5_000
        seconds = min(timeit.repeat(lambda: recorder.observe("q", jobs, counters),  # type: ignore[arg-type]
                                    number=rounds, repeat=5))
        print(seconds / rounds / BATCH * 1e6)


if __name__ == "__main__":
    main()
