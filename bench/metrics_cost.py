"""``python -m bench.metrics_cost``: microseconds a slot spends recording the metrics of one
job (a batch of 100 through the real ``SlotMetrics.observe``, prometheus_client in the
multiprocess mode slots run in). Prints one number. Run as its own process: the mode is
chosen when prometheus_client is first imported."""

from __future__ import annotations

import os
import tempfile
import timeit

BATCH = 100


def main() -> None:
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = d
        from qcluster.job import Delivery, Job
        from qcluster.messages import BatchCounters
        from qcluster.slot.slot_metrics import SlotMetrics

        recorder = SlotMetrics("slot1")
        jobs = []
        for n in range(BATCH):
            activate_at = 999.99 - n * 1e-5
            delivery = Delivery(id=str(n), body=b"{}", attempts=1, activate_at=activate_at,
                                taken_at=1000.0)
            job = Job(id=str(n), queue="q", payload={}, attempts=1, enqueued_at=activate_at,
                      activate_at=activate_at, delivery=delivery)
            job.outcome = "done"
            jobs.append(job)
        counters = BatchCounters(done=BATCH, batches=1, busy_s=3e-4)
        rounds = 5_000
        seconds = min(timeit.repeat(lambda: recorder.observe("q", jobs, counters),
                                    number=rounds, repeat=5))
        print(seconds / rounds / BATCH * 1e6)


if __name__ == "__main__":
    main()
