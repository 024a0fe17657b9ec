"""What a failing job costs a slot, in-process (no broker): the settlement, the failure
path (last error per job, one traceback per exception, the log line or its summary) and
the same jobs settled as successes, side by side.

    python -m bench.failure_cost

Three shapes: a batch handler that raises once for 100 jobs, a per-job handler whose 100
jobs each raise, and batches of one. Logging goes to /dev/null (the first three of a
kind are formatted in full, the rest are counted, as in a slot).
"""

from __future__ import annotations

import logging
import random
import time

from qcluster.app import App
from qcluster.job import Delivery, Job
from qcluster.slot.failure_report import FailureReporter
from qcluster.slot.settle import settle_batch

ROUNDS = 300


def _jobs(count: int) -> list[Job]:
    out = []
    for index in range(count):
        delivery = Delivery(f"{index:032x}", b"", 1, 0.0, 0.0)
        out.append(Job(delivery.id, "q", {}, 1, 0.0, 0.0, {}, delivery))
    return out


def _raise() -> None:
    raise ValueError("the service said no")


def _fail(jobs: list[Job], per_job: bool) -> None:
    if per_job:
        for job in jobs:
            try:
                _raise()
            except ValueError as exc:
                job.mark_error(exc)
        return
    try:
        _raise()
    except ValueError as exc:
        for job in jobs:
            job.mark_error(exc)


def us_per_job(count: int, per_job: bool, *, failing: bool) -> float:
    app = App()
    app.queue("q", max_attempts=5)(lambda jobs: None)
    policy = app.spec("q").policy
    reporter = FailureReporter("1", "bench", [])
    spent = 0.0
    for _ in range(ROUNDS):
        jobs = _jobs(count)
        started = time.perf_counter()
        if failing:
            _fail(jobs, per_job)
        settlement, _ = settle_batch(jobs, policy, rand=random.random)
        if failing:
            failures = reporter.collect("q", jobs, settlement, policy, time.time())
            reporter.report(failures, 5.0)
        spent += time.perf_counter() - started
    return spent / (ROUNDS * count) * 1e6


def main() -> None:
    logging.basicConfig(stream=open("/dev/null", "w"), level=logging.INFO)  # noqa: SIM115
    for count, per_job, shape in ((100, False, "batch 100, one exception"),
                                  (100, True, "batch 100, an exception per job"),
                                  (1, False, "batch 1")):
        us_per_job(count, per_job, failing=True)  # warm up
        failing = us_per_job(count, per_job, failing=True)
        ok = us_per_job(count, per_job, failing=False)
        print(f"{shape}: failing {failing:.1f} us/job, succeeding {ok:.1f} us/job")


if __name__ == "__main__":
    main()
