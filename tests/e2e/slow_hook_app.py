"""The app of tests/e2e/test_slow_hook.py: a handler that always raises, and a failure
hook that waits until the test lets it go (a file named ``release`` appears in the log
directory), then writes down what it saw."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from qcluster import App, Job
from qcluster.hooks import Failure

PREFIX = os.environ.get("QC_TEST_PREFIX", "s")
LOG_DIR = Path(os.environ.get("QC_TEST_LOG_DIR", "/tmp"))
#: The hook's own timeout: far past the master's heartbeat timeout in the test.
HOOK_TIMEOUT_S = 40.0

app = App("slow-hook")


class DoomedError(Exception):
    pass


@app.queue(f"{PREFIX}-doomed", batch_size=1, max_attempts=1)
def doomed(jobs: list[Job]) -> None:
    raise DoomedError(f"job {jobs[0].payload} can never work")


@app.on_failure(timeout=HOOK_TIMEOUT_S)
def slow(failure: Failure) -> None:
    deadline = time.monotonic() + HOOK_TIMEOUT_S
    while not (LOG_DIR / "release").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    record = {"ids": [job.id for job in failure.jobs], "next": failure.next,
              "pid": os.getpid()}
    with (LOG_DIR / "hook.log").open("a") as out:
        out.write(json.dumps(record) + "\n")
