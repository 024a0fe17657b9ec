"""A queue's declared options govern every process that declares it: a producer that
imported the app, or whose settings name it, declares the app's quorum queue as quorum
with a plain ``Client(url)`` (it declared it classic, and the app's slots then found a
classic queue where they wanted a quorum one)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.contract.test_rabbitmq_quorum import queue_types

APP_MODULE = '''
import os
from qcluster import App, Job

app = App("producer-policies")


@app.queue(os.environ["QC_TEST_QUEUE"], queue_type="quorum", max_attempts=4)
def handle(jobs: list[Job]) -> None: ...
'''

#: A producer: nothing but a Client of the URL (what the app declares is found by it).
PRODUCE = "from qcluster import Client; Client({url!r}).enqueue({queue!r}, {{'n': 1}})"


def produce(tmp_path: Path, code: str, **env: str) -> None:
    (tmp_path / "policies_app.py").write_text(APP_MODULE)
    environment = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{Path.cwd()}", **env}
    environment.pop("QCLUSTER_APP", None)
    environment.update(env)
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=environment,
                   check=True, timeout=120)


@pytest.mark.parametrize("how", ["imported", "settings"])
def test_a_producer_that_knows_the_app_declares_its_quorum_queue(
        rabbitmq_url: str, queue_name: str, tmp_path: Path, how: str) -> None:
    """Failed before the fix: the queue was a classic queue, in both ways."""
    code = PRODUCE.format(url=rabbitmq_url, queue=queue_name)
    if how == "imported":
        produce(tmp_path, f"import policies_app\n{code}", QC_TEST_QUEUE=queue_name)
    else:
        produce(tmp_path, code, QC_TEST_QUEUE=queue_name, QCLUSTER_APP="policies_app")
    assert queue_types(queue_name)[queue_name] == "quorum"


def test_a_producer_that_knows_no_app_declares_as_the_url_says(
        rabbitmq_url: str, queue_name: str, tmp_path: Path) -> None:
    """No app known to the producer: the URL's ``?queue_type=`` decides (else classic),
    the cluster-wide default every process shares (docs/operations.md, "Quorum
    queues")."""
    url = rabbitmq_url + ("&" if "?" in rabbitmq_url else "?") + "queue_type=quorum"
    produce(tmp_path, PRODUCE.format(url=url, queue=queue_name), QC_TEST_QUEUE="other")
    assert queue_types(queue_name)[queue_name] == "quorum"
