"""What finished-job records and the failure path cost per job, on Redis at batch 100.

    python -m bench.retention_bench [--jobs N] [--repeat N]

A real slot loop (``SlotRunner``, in this process) drains a queue of no-op jobs; CPU per
job is this process's CPU (the slot: take, decode, run, settle) plus the Redis server's
(``INFO cpu``: the scripts and the network), read around each drain. Systems alternate
(A B C A B C ...) in one run, so each pair sees the same machine:

- ``keep_finished_s=300`` (the default) against ``keep_finished_s=0``: the cost of the
  finished records (target: at most 5% more per job);
- a handler that raises for every job (each postponed with its error, when the slot hands
  the error over) against the no-op: the failure path per job;
- at the broker alone, a settle of 100 postponed jobs with their errors against one without
  (what storing the last error adds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from bench.common import REDIS, enqueue_noops, summary, unique
from qcluster import App, Job
from qcluster.broker import DeadRetention, Settlement, open_broker
from qcluster.client import Client
from qcluster.failures import JobError
from qcluster.slot.runtime import SlotRunner

BATCH = 100


def _redis_cpu_s(client: Any) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _app(queue: str, *, keep_s: float, fail: bool) -> App:
    app = App("retention-bench")

    @app.queue(queue, batch_size=BATCH, keep_finished_s=keep_s, retry_base_delay=3600.0,
               retry_max_delay=3600.0, max_attempts=10)
    def handle(jobs: list[Job]) -> None:
        if fail:
            raise ConnectionError("the mail server went away")

    return app


def slot_drain(jobs: int, *, keep_s: float, fail: bool = False) -> float:
    """Microseconds of CPU (slot + Redis) per job, draining ``jobs`` jobs."""
    queue = unique("ret")
    with Client(REDIS) as client:
        enqueue_noops(client, queue, jobs)
    broker = open_broker(REDIS)
    runner = SlotRunner(_app(queue, keep_s=keep_s, fail=fail), queue, broker, burst=True)
    server = broker.client  # type: ignore[attr-defined]
    try:
        redis_before, cpu_before = _redis_cpu_s(server), time.process_time()
        while runner.step(defer_settle=True):
            pass
        used = time.process_time() - cpu_before + _redis_cpu_s(server) - redis_before
    finally:
        broker.delete_queue(queue)
        broker.close()
    return used / jobs * 1e6


def settle_errors(jobs: int, *, with_errors: bool) -> float:
    """Microseconds of CPU (client + Redis) per job of take + settle-postponed, with or
    without each job's error."""
    queue = unique("err")
    with Client(REDIS) as client:
        enqueue_noops(client, queue, jobs)
    broker = open_broker(REDIS)
    server = broker.client  # type: ignore[attr-defined]
    error = JobError.bounded(type="ConnectionError", message="the mail server went away",
                             traceback="Traceback (most recent call last):\n" * 20,
                             host="bench", slot="bench-1", attempt=1, at=time.time())
    try:
        redis_before, cpu_before = _redis_cpu_s(server), time.process_time()
        while taken := broker.take(queue, max_jobs=BATCH, lock_timeout_s=60):
            errors = {d.id: error for d in taken} if with_errors else {}
            broker.settle(queue, Settlement(postpone=[(d, 3600.0) for d in taken],
                                            errors=errors))
        used = time.process_time() - cpu_before + _redis_cpu_s(server) - redis_before
    finally:
        broker.delete_queue(queue)
        broker.close()
    return used / jobs * 1e6


SYSTEMS = {
    "slot batch 100, keep_finished_s=300": lambda n: slot_drain(n, keep_s=300.0),
    "slot batch 100, keep_finished_s=0": lambda n: slot_drain(n, keep_s=0.0),
    "slot batch 100, every job raises": lambda n: slot_drain(n, keep_s=300.0, fail=True),
    "settle 100 postponed, with errors": lambda n: settle_errors(n, with_errors=True),
    "settle 100 postponed, no errors": lambda n: settle_errors(n, with_errors=False),
    "take + ack 100, keep_finished_s=300": lambda n: broker_path(n, keep_s=300.0),
    "take + ack 100, keep_finished_s=0": lambda n: broker_path(n, keep_s=0.0),
}


def broker_path(jobs: int, *, keep_s: float) -> float:
    """Microseconds of CPU (client + Redis) per job of take + settle-acked alone (no slot
    around it), keeping finished records or not: the records' cost in absolute terms."""
    queue = unique("ack")
    with Client(REDIS) as client:
        enqueue_noops(client, queue, jobs)
    broker = open_broker(REDIS)
    server = broker.client  # type: ignore[attr-defined]
    retention = DeadRetention(keep_finished_s=keep_s)
    try:
        redis_before, cpu_before = _redis_cpu_s(server), time.process_time()
        taken = broker.take(queue, max_jobs=BATCH, lock_timeout_s=60)
        while taken:
            taken = broker.settle_and_take(queue, Settlement(ack=taken, retention=retention),
                                           max_jobs=BATCH, lock_timeout_s=60)
        used = time.process_time() - cpu_before + _redis_cpu_s(server) - redis_before
    finally:
        broker.delete_queue(queue)
        broker.close()
    return used / jobs * 1e6


def run(jobs: int = 20_000, repeat: int = 6) -> dict[str, Any]:
    """Each round runs every system once, the order reversed every other round (A B C,
    C B A, ...): a system is never always the first after a pause."""
    runs: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    for round_no in range(repeat):
        order = list(SYSTEMS.items())
        for name, system in order if round_no % 2 == 0 else reversed(order):
            value = system(jobs)
            runs[name].append(value)
            print(f"  [{round_no + 1}/{repeat}] {name}: {value:.2f} us/job", flush=True)
    table = {name: summary(values) for name, values in runs.items()}

    def paired(a: str, b: str) -> float:
        """The median of the round-by-round ratios (each pair ran side by side)."""
        return statistics.median(x / y for x, y in zip(runs[a], runs[b], strict=True))

    keep, none = "slot batch 100, keep_finished_s=300", "slot batch 100, keep_finished_s=0"
    return {
        "us_per_job": table,
        "finished_records_overhead": paired(keep, none) - 1,
        "finished_records_target": 0.05,
        "failure_path_us_per_job": table["slot batch 100, every job raises"]["median"]
        - table[none]["median"],
        "failure_path_ratio": paired("slot batch 100, every job raises", keep),
        "finished_records_us_per_job": table["take + ack 100, keep_finished_s=300"]["median"]
        - table["take + ack 100, keep_finished_s=0"]["median"],
        "finished_records_broker_overhead": paired("take + ack 100, keep_finished_s=300",
                                                   "take + ack 100, keep_finished_s=0") - 1,
        "error_record_us_per_job": table["settle 100 postponed, with errors"]["median"]
        - table["settle 100 postponed, no errors"]["median"],
        "jobs_per_run": jobs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=6)
    args = parser.parse_args()
    print(json.dumps(run(args.jobs, args.repeat), indent=2))


if __name__ == "__main__":
    main()
