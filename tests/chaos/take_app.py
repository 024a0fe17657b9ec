"""The app of tests/chaos/test_crash_take.py: per-job queues whose one take holds ten jobs
(batch_size 10): ``PREFIX-take`` with ``max_attempts`` 3 and ``PREFIX-take1`` with 1; and
``PREFIX-takeb1``, batch_size 1, ``max_attempts`` 3 (a fast handler's slot takes and reads
ahead several batches of 1 at once). A job
whose payload says ``poison: "exit"`` kills its slot (``os._exit(70)``) on every attempt.
Every run is in the chaos ledger (start, then abort or finish), with the attempt number the
job was given."""

from __future__ import annotations

import os

from qcluster import App, Job
from tests.chaos.ledger import record

PREFIX = os.environ.get("QC_CHAOS_PREFIX", "chaos")
#: Jobs each case enqueues: a take of batch_size 10 holds them all.
JOBS = 10
#: Queue kind -> max_attempts.
KINDS = {"take": 3, "take1": 1, "takeb1": 3}
#: Queue kind -> batch_size.
BATCH_SIZE = {"take": JOBS, "take1": JOBS, "takeb1": 1}

app = App("chaos-take")


def name(kind: str, prefix: str = PREFIX) -> str:
    return f"{prefix}-{kind}"


def run(job: Job) -> None:
    record("start", [job])
    if isinstance(job.payload, dict) and job.payload.get("poison") == "exit":
        record("abort", [job], kind="exit")
        os._exit(70)
    record("finish", [job])


for _kind, _max_attempts in KINDS.items():
    app.job_queue(name(_kind), batch_size=BATCH_SIZE[_kind], lock_timeout=3.0,
                  max_attempts=_max_attempts, retry_base_delay=1.0, retry_max_delay=4.0)(run)
