"""Periodic jobs run where the app runs: a manager that is not given the app learns its
``@app.periodic`` declarations from the master that imports it, and says (page and log)
which configured job it cannot run for want of a declaration. Real processes on the
embedded broker, in a directory of their own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import httpx

from tests.brokers import free_port
from tests.conftest import QCLUSTER, qcluster_env, wait_until

APP = '''import qcluster

app = qcluster.App("learned")


@app.periodic(every=1, queue="beats", name="beat")
@app.queue("beats", min_slots=1, max_slots=1)
def beats(jobs):
    with open("beats.log", "a") as log:
        log.write(f"{len(jobs)}\\n")
'''


def test_the_manager_runs_the_periodic_jobs_its_masters_declare(tmp_path: Path) -> None:
    (tmp_path / "learned_app.py").write_text(APP)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in qcluster_env().items() if not k.startswith("QCLUSTER_")}
    manager_env = {**env, "QCLUSTER_PERIODIC": json.dumps({"nightly": {"catch_up": "latest"}})}
    procs = []
    for name, args, with_env in (
            ("manager", ["manager", "--listen", f"127.0.0.1:{port}"], manager_env),
            ("master", ["master", "--app", "learned_app", "--no-metrics", "--manager", url,
                        "--host-name", "h1", "--listen", str(free_port())], env)):
        with (tmp_path / f"{name}.log").open("wb") as log:
            procs.append(subprocess.Popen([*QCLUSTER, *args], cwd=tmp_path, env=with_env,
                                          stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    beats = tmp_path / "beats.log"
    try:
        wait_until(lambda: beats.exists() and beats.read_text().strip(), timeout_s=90,
                   message="a tick of the learned periodic job run by a slot")
        page = httpx.get(f"{url}/", timeout=10).text
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            proc.wait(timeout=60)
    log = (tmp_path / "manager.log").read_text()
    assert "periodic jobs learned from master h1: beat" in log
    assert ("periodic nightly: [periodic.nightly] changes a job no reporting master's app "
            "declares (yet): it runs once a master reports it") in log
    assert 'data-periodic="beat"' in page
    assert 'data-periodic="nightly"' in page and "not running: [periodic.nightly]" in page
