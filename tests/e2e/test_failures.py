"""Every failure seen, on a real ``qcluster master`` (Redis and the embedded broker): a
handler that fails twice then succeeds and one that always fails. The master's log holds
each traceback with what happens next, a poison queue's beyond the first few summarised;
the failure hook saw every outcome; /metrics counts the failures; each process's title
says what it is."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import psutil
import pytest

from qcluster.client import Client
from tests.conftest import free_port, wait_until
from tests.e2e.cluster import Procs, get_json, get_text

APP = "tests.e2e.failures_app:app"
POISON_JOBS = 20


def records(logs: Path, kind: str) -> list[dict[str, Any]]:
    out = []
    for path in logs.glob(f"{kind}-*.log"):
        out += [json.loads(line) for line in path.read_text().splitlines() if line]
    return out


@pytest.mark.parametrize("broker_url", ["redis", "embedded"], indirect=True)
def test_failures_reach_the_masters_log_the_hook_and_the_metrics(
    procs: Procs, broker_url: str, prefix: str, logs: Path
) -> None:
    flaky, poison = f"{prefix}-flaky", f"{prefix}-poison"
    port = free_port()
    master = procs.start("master", "master", "--app", APP, "--broker", broker_url,
                         "--slots", f"{flaky}=1,{poison}=1", "--listen", f"127.0.0.1:{port}",
                         "--host-name", "test")
    wait_until(lambda: _answers(port), timeout_s=60, message="master up")
    with Client(broker_url) as client:
        flaky_ids = client.enqueue_many(flaky, ["a", "b"])
        poison_ids = client.enqueue_many(poison, list(range(POISON_JOBS)))
        wait_until(lambda: len(records(logs, "finished")) == 2, timeout_s=60,
                   message="each flaky job finished on its third attempt")
        wait_until(lambda: client.stats(poison)["dead"] == POISON_JOBS, timeout_s=60,
                   message="every poison job dead-lettered")
        reasons = {d.reason for d in client.dead_jobs(poison, limit=100)}
    assert {r.split(": last error")[0] for r in reasons} == {
        "attempt 2 of 2 raised and no attempt is left (max_attempts 2)"}

    hooks = records(logs, "hook")
    seen = Counter((job_id, h["next"], h["attempt"]) for h in hooks for job_id in h["ids"])
    expected = Counter({(i, "retry", n): 1 for i in flaky_ids for n in (1, 2)})
    expected.update({(i, nxt, n): 1 for i in poison_ids for nxt, n in (("retry", 1), ("dead", 2))})
    assert seen == expected
    assert all(h["traceback"] for h in hooks)

    # The slot's lines are in the master's log, each with its traceback: per queue the
    # first three of a kind in full, the others summarised once their 10 s window ended.
    wait_until(lambda: procs.log("master").count("more like it in") >= 2, timeout_s=60,
               message="both queues' summaries in the master's log")
    log = procs.log("master")
    for queue, error, attempts, failures in (
            (flaky, "FlakyError", 5, 2 * len(flaky_ids)), (poison, "PoisonError", 2,
                                                           2 * POISON_JOBS)):
        full = re.findall(rf"\({queue}\): job \w+, attempt \d of {attempts}, raised "
                          rf"tests\.e2e\.failures_app\.{error}: ", log)
        more = [int(n) for n in re.findall(
            rf"slot \d+ \({queue}\): \.\.\. and (\d+) more like it in \d+ s \(tests\.e2e"
            rf"\.failures_app\.{error} raised at \S+failures_app.py:\d+\)", log)]
        assert len(full) == 3 and len(full) + sum(more) == failures, (queue, len(full), more)
        assert log.count(f"raise {error}(") == len(full)  # a traceback per full line
    assert "attempt 1 of 5, raised tests.e2e.failures_app.FlakyError: attempt 1 of job " \
           "a fails; retry at " in log

    metrics = get_text(port, "/metrics")
    assert (f'qcluster_job_failures_total{{exception="tests.e2e.failures_app.PoisonError",'
            f'queue="{poison}"}} {2.0 * POISON_JOBS}') in metrics
    titles = {" ".join(p.cmdline()).strip() for p in psutil.Process(master.pid).children()}
    assert f"qcluster slot {flaky} (test, gen 0)" in titles, titles
    assert f"qcluster slot {poison} (test, gen 0)" in titles, titles
    assert " ".join(psutil.Process(master.pid).cmdline()).strip() == "qcluster master (test)"
    assert {p.name() for p in psutil.Process(master.pid).children()} == {"qc-slot"}


def _answers(port: int) -> bool:
    try:
        return bool(get_json(port, "/api/v1/slots"))
    except OSError:
        return False
