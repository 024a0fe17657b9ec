"""A producer that enqueues to a near miss of a queue the apps it knows declare is told so,
once per queue, on stderr: from a script that defines the app (the README's shop.py) as from
one whose settings name it. A misspelt queue was stored in silence, and its jobs waited for
a slot that never came."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

APP = '''
from qcluster import App, Job

app = App("shop")


@app.queue("emails")
def send_emails(jobs: list[Job]) -> None: ...
'''

ENQUEUE = '''
from qcluster import Client
client = Client({url!r})
for queue in {queues!r}:
    client.enqueue(queue, {{"to": "ada@example.com"}})
'''


def produce(tmp_path: Path, code: str, **env: str) -> str:
    (tmp_path / "shop.py").write_text(APP)
    environment = {k: v for k, v in os.environ.items() if not k.startswith("QCLUSTER_")}
    environment["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{Path.cwd()}"
    environment.update(env)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=environment,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_a_script_defining_the_app_is_told_of_a_misspelt_queue_once(
        tmp_path: Path, redis_url: str) -> None:
    code = "import shop\n" + ENQUEUE.format(url=redis_url,
                                            queues=["emials", "emials", "emails"])
    said = produce(tmp_path, code)
    assert said.splitlines() == [
        "enqueue to 'emials': no queue of app 'shop' has that name, so no slot will run "
        "these jobs (did you mean emails?)"], said


def test_another_apps_queue_says_nothing(tmp_path: Path, redis_url: str) -> None:
    """This process knows the shop's app, not every app of the cluster: a queue of another
    (no near miss of the shop's) is not a typo. A bench enqueueing to its own queue beside
    a fleet of 150 got a warning listing them all."""
    code = "import shop\n" + ENQUEUE.format(url=redis_url, queues=["thumbnails"])
    assert produce(tmp_path, code) == ""


def test_a_producer_whose_settings_name_the_app_is_told_too(
        tmp_path: Path, redis_url: str) -> None:
    said = produce(tmp_path, ENQUEUE.format(url=redis_url, queues=["emials", "emails"]),
                   QCLUSTER_APP="shop")
    assert "enqueue to 'emials': no queue of app 'shop' has that name" in said, said
    assert "'emails'" not in said


def test_a_producer_that_knows_no_app_says_nothing(tmp_path: Path, redis_url: str) -> None:
    assert produce(tmp_path, ENQUEUE.format(url=redis_url, queues=["anything"])) == ""


def test_a_settings_app_that_raises_at_import_does_not_fail_the_producer(
        tmp_path: Path, redis_url: str) -> None:
    """A producer whose environment names the workers' app (QCLUSTER_APP shared by every
    service) failed every enqueue with the app's own exception, here a setting only the
    workers have: it is said once, and the job is stored."""
    (tmp_path / "workers.py").write_text(
        "from qcluster import App\napp = App()\nraise RuntimeError('database not configured')\n")
    queue = f"mail-{uuid.uuid4().hex[:8]}"
    code = ENQUEUE.format(url=redis_url, queues=[queue, "thumbnails"]) + (
        f"print(client.stats({queue!r})['ready'])\n")
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
        timeout=120, env={**{k: v for k, v in os.environ.items() if not k.startswith(
            "QCLUSTER_")}, "PYTHONPATH": f"{tmp_path}{os.pathsep}{Path.cwd()}",
            "QCLUSTER_APP": "workers"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1"]
    assert done.stderr.splitlines() == [
        "queues are declared as the broker URL says, not as app workers says: RuntimeError: "
        "database not configured"], done.stderr
