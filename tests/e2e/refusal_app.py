"""The app of tests/e2e/test_broker_refusal.py: a queue that wants to be a quorum queue
(its name from QC_TEST_PREFIX); the test makes it a classic queue first."""

from __future__ import annotations

import os

from qcluster import App, Job

PREFIX = os.environ.get("QC_TEST_PREFIX", "r")

app = App("refusal")


@app.queue(f"{PREFIX}-quorum", queue_type="quorum")
def handle(jobs: list[Job]) -> None:
    pass
