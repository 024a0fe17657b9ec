"""The docs' examples, run as written: docs/tutorial.md, the README's example application
and the qcluster side of docs/coming-from-celery.md.

The tutorial: every fenced block, in order, in a fresh directory.

- ``sh`` blocks run in bash (``-e``: a failing command fails the test); a block whose first
  line is ``# a new terminal: keeps running`` is started in the background, as the reader
  would in another terminal, and stopped at the end;
- ``python file=NAME`` / ``toml file=NAME`` blocks are written to NAME, ``append=NAME``
  blocks appended to it;
- ``text`` blocks show output and are not run; the one block that installs qcluster with
  pip is not run either: the test runs in the project's own environment.

The tutorial's placeholders are replaced in every block: its Redis URL by a private
redis-server of this test (tests/brokers.py) and its ports 7300-7302 by free ones. After a
block, the checks named after its commands wait for what the tutorial says happens (the
manager answers, both masters report, the jobs are done, the queue is paused); each check
must be used, so a tutorial that drops a step fails here too.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from qcluster import Client
from qcluster.broker.embedded import stop_embedded
from tests.brokers import BrokerUnavailable, PrivateRedis, free_port
from tests.conftest import ROOT, wait_until

TUTORIAL = ROOT / "docs" / "tutorial.md"
FENCE = re.compile(r"^```(\w*)[ \t]*(\S*)[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
BACKGROUND = "# a new terminal: keeps running"
REDIS_PLACEHOLDER = "redis://127.0.0.1:6379/0"
PORT_PLACEHOLDERS = ("127.0.0.1:7300", "127.0.0.1:7301", "127.0.0.1:7302")
#: One command runs at most this long (a rolling reload of two hosts takes about 15 s).
COMMAND_TIMEOUT_S = 300.0


@dataclass
class Block:
    lang: str
    attribute: str
    text: str


def tutorial_blocks(text: str) -> list[Block]:
    return [Block(lang, attribute, body) for lang, attribute, body in FENCE.findall(text)]


@dataclass
class Reader:
    """The reader of the tutorial: a directory, a shell, terminals left running."""

    workdir: Path
    substitutions: dict[str, str]
    env: dict[str, str]
    terminals: list[subprocess.Popen[bytes]] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)

    def text(self, block: Block) -> str:
        text = block.text
        for placeholder, value in self.substitutions.items():
            text = text.replace(placeholder, value)
        return text

    def write(self, block: Block) -> None:
        kind, _, name = block.attribute.partition("=")
        path = self.workdir / name
        with path.open("a" if kind == "append" else "w") as file:
            file.write(self.text(block))

    def run(self, block: Block) -> str:
        done = subprocess.run(["bash", "-e", "-c", self.text(block)], cwd=self.workdir,
                              env=self.env, capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S)
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"{block.text}exit {done.returncode}:\n{output}"
        self.outputs.append(output)
        return output

    def start(self, block: Block) -> None:
        log = (self.workdir / f"terminal-{len(self.terminals) + 1}.log").open("ab")
        self.terminals.append(subprocess.Popen(
            ["bash", "-c", self.text(block)], cwd=self.workdir, env=self.env,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def stop(self) -> list[int | None]:
        """Ctrl-C in each terminal, as step 11 says: how each ended (None: it had to be
        killed); what is left of its process group is killed."""
        for proc in self.terminals:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
        ended: list[int | None] = []
        for proc in self.terminals:
            with suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=60)
            ended.append(proc.returncode)
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return ended

    def logs(self) -> str:
        return "\n".join(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}"
                         for path in sorted(self.workdir.glob("terminal-*.log")))


@dataclass
class Cluster:
    """What the checks look at: the manager's view and the broker's counts."""

    manager_port: int
    redis_url: str

    def view(self) -> dict[str, Any] | None:
        url = f"http://127.0.0.1:{self.manager_port}/api/v1/cluster"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return dict(json.loads(response.read()))
        except OSError:
            return None

    def queue(self, name: str) -> dict[str, Any]:
        view = self.view() or {"queues": []}
        return next((q for q in view["queues"] if q["name"] == name), {})

    def hosts(self) -> set[str]:
        view = self.view() or {"hosts": []}
        return {host["name"] for host in view["hosts"] if host["alive"]}

    def done(self, queue: str) -> bool:
        with Client(self.redis_url) as client:
            stats = client.stats(queue)
        return stats["ready"] + stats["locked"] + stats["delayed"] == 0


def _wait_done(cluster: Cluster, *queues: str) -> None:
    for queue in queues:
        wait_until(partial(cluster.done, queue), timeout_s=120, message=f"{queue} done")


def checks(cluster: Cluster, workdir: Path) -> dict[str, Callable[[str], None]]:
    """Keyed by a command of the tutorial; called with the block's output after it ran."""

    def manager(_output: str) -> None:
        wait_until(lambda: cluster.view() is not None, timeout_s=60, message="the manager")

    def master(host: str) -> Callable[[str], None]:
        return lambda _output: wait_until(lambda: host in cluster.hosts(), timeout_s=90,
                                          message=f"{host} reporting")

    def enqueued(output: str) -> None:
        # "enqueued N job(s) to 'Q'" for --count; one job alone prints its id only
        queues = set(re.findall(r"enqueued \d+ job\(s\) to '([\w.:-]+)'", output))
        if not cluster.queue("thumbnails").get("paused"):
            _wait_done(cluster, *sorted(queues))

    def paused(_output: str) -> None:
        # Not waited for here: the reader enqueues next, and the jobs stay ready only once
        # the paused queue's slots are gone (`pause --wait`).
        queue = cluster.queue("thumbnails")
        assert queue.get("paused") is True and queue.get("slots_current") == 0, queue

    def still_waiting(output: str) -> None:
        assert re.search(r"thumbnails\s*│\s*10\s*│", output), output

    def resumed(_output: str) -> None:
        assert not cluster.queue("thumbnails").get("paused")
        _wait_done(cluster, "thumbnails")

    return {
        "qcluster manager": manager,
        "qcluster master --host-name host-a": master("host-a"),
        "qcluster master --host-name host-b": master("host-b"),
        "qcluster enqueue": enqueued,
        "qcluster dead emails": lambda out: _expect(out, "not an email address"),
        "qcluster job": lambda out: _expect(out, "state: "),
        "qcluster pause thumbnails": paused,
        "qcluster controls": lambda out: _expect(out, "thumbnails"),
        "qcluster stats thumbnails": still_waiting,
        "qcluster resume thumbnails": resumed,
        "qcluster reload --all --wait": lambda out: _expect(out, "2 of 2 host(s) took"),
        "qcluster simulate": lambda _out: _expect((workdir / "report.html").read_text(),
                                                  "<html"),
    }


def _expect(output: str, text: str) -> None:
    assert text in output, output


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[str]:
    """An empty Redis of this test alone: `qcluster stats` shows the tutorial's queues only."""
    server = PrivateRedis(tmp_path / "redis")
    try:
        url = server.start()
    except BrokerUnavailable as error:
        pytest.fail(str(error), pytrace=False)
    try:
        yield url
    finally:
        server.stop()


def reader_env() -> dict[str, str]:
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("QCLUSTER_", "PYTHONPATH"))}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["COLUMNS"] = "200"  # tables unwrapped, as in a wide terminal
    return env


def test_the_tutorial_runs_as_written(redis: str, tmp_path: Path) -> None:
    workdir = tmp_path / "first-cluster"
    workdir.mkdir()
    ports = [free_port() for _ in PORT_PLACEHOLDERS]
    substitutions = dict(zip(PORT_PLACEHOLDERS, [f"127.0.0.1:{port}" for port in ports],
                             strict=True))
    substitutions[REDIS_PLACEHOLDER] = redis
    reader = Reader(workdir, substitutions, reader_env())
    cluster = Cluster(ports[0], redis)
    pending = checks(cluster, workdir)
    used: set[str] = set()
    blocks = tutorial_blocks(TUTORIAL.read_text())
    installs = [b for b in blocks if b.lang == "sh" and "pip install" in b.text]
    assert len(installs) == 1, "one block installs qcluster"
    ended: list[int | None] = []
    try:
        for block in blocks:
            if block.lang == "text" or block in installs:
                continue
            if block.attribute:
                reader.write(block)
                continue
            assert block.lang == "sh", f"a ```{block.lang} block without file= or append="
            background = block.text.startswith(BACKGROUND)
            if background:
                reader.start(block)
            output = "" if background else reader.run(block)
            for command, check in pending.items():
                if command in block.text:
                    check(output)
                    used.add(command)
    except BaseException:
        print(reader.logs())
        raise
    finally:
        ended = reader.stop()
    assert used == set(pending), f"steps the tutorial no longer has: {set(pending) - used}"
    assert ended == [0, 0, 0], f"manager, host-a, host-b after Ctrl-C: {ended}\n{reader.logs()}"


def section(text: str, heading: str) -> str:
    """The text under ``## heading``, up to the next ``## ``."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def test_the_readme_example_runs_as_written(tmp_path: Path) -> None:
    """README, "An application in 20 lines": the app enqueues its job on the embedded broker
    of its directory, a master with a fixed row runs it, Ctrl-C stops the master."""
    readme = (ROOT / "README.md").read_text()
    blocks = tutorial_blocks(section(readme, "An application in 20 lines"))
    [app] = [block for block in blocks if block.lang == "python"]
    [shell] = [block for block in blocks if block.lang == "sh"]
    assert len(app.text.splitlines()) <= 22, "the README's example stays about 20 lines"
    (tmp_path / "shop.py").write_text(app.text)
    commands = {line.split("#")[0].split()[0]: line.split("#")[0].strip()
                for line in shell.text.splitlines()}
    env = reader_env()
    run = partial(subprocess.run, cwd=tmp_path, env=env, capture_output=True, text=True,
                  timeout=COMMAND_TIMEOUT_S)
    enqueued = run(["bash", "-c", commands["python"]])
    assert enqueued.returncode == 0, enqueued.stderr
    master = f"{commands['qcluster']} --listen 127.0.0.1:{free_port()}"
    log = (tmp_path / "master.log").open("ab")
    proc = subprocess.Popen(["bash", "-c", f"exec {master}"], cwd=tmp_path, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    outbox = tmp_path / "outbox.txt"
    try:
        wait_until(lambda: outbox.exists() and "to ada@example.com: Your order" in
                   outbox.read_text(), timeout_s=120, message="the job done")
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        finally:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            stop_embedded(tmp_path / ".qcluster")
    assert proc.wait() == 0, (tmp_path / "master.log").read_text()
    shown = run(["bash", "-c", commands["cat"]])
    assert shown.stdout == "to ada@example.com: Your order\n"


CELERY_STUBS = {
    "mailer.py": "import pathlib\n\n\nclass Busy(Exception):\n    pass\n\n\n"
                 "def send(to, subject):\n    if to.endswith('@busy.example'):\n"
                 "        raise Busy(to)\n"
                 "    with pathlib.Path('sent.txt').open('a') as sent:\n"
                 "        sent.write(f'{to} {subject}\\n')\n",
    "reports.py": "def build():\n    pass\n",
}


def test_the_celery_guide_qcluster_side_runs(tmp_path: Path) -> None:
    """docs/coming-from-celery.md: its qcluster app imports (with stand-ins for the user's
    mailer and reports modules), declares the queues and the periodic job it says, its
    qcluster.toml is valid, and a slot runs a job to done and postpones a busy one."""
    from qcluster.app import load_app
    from qcluster.config import load_settings

    blocks = tutorial_blocks((ROOT / "docs" / "coming-from-celery.md").read_text())
    [jobs] = [b for b in blocks if b.lang == "python" and b.text.startswith("# jobs.py")]
    [toml] = [b for b in blocks if b.lang == "toml"]
    (tmp_path / "jobs.py").write_text(jobs.text)
    for name, text in CELERY_STUBS.items():
        (tmp_path / name).write_text(text)
    config = tmp_path / "qcluster.toml"
    config.write_text(toml.text.replace('"..."', '"a-strong-enough-token-9f3c2e1d7b"'))
    settings = load_settings(config)
    assert settings.app == "jobs" and settings.broker_url == "redis://:PASSWORD@redis-host:6379/1"
    config.unlink()  # the job below runs on the embedded broker of tmp_path, not that Redis
    env = {**reader_env(), "PYTHONPATH": str(tmp_path)}
    sys.path.insert(0, str(tmp_path))
    try:
        app = load_app("jobs")
    finally:
        sys.path.remove(str(tmp_path))
        for name in ("jobs", "mailer", "reports"):
            sys.modules.pop(name, None)
    assert set(app.queues) == {"send_email", "build_report"}
    nightly = app.periodic_jobs["build_report"]
    assert (nightly.queue, nightly.cron) == ("build_report", "0 3 * * *")
    run = partial(subprocess.run, cwd=tmp_path, env=env, capture_output=True, text=True,
                  timeout=COMMAND_TIMEOUT_S)
    for to in ("ada@example.com", "bob@busy.example"):
        payload = json.dumps({"to": to, "subject": "Your order"})
        assert run(["qcluster", "enqueue", "send_email", payload]).returncode == 0
    slot = run(["qcluster", "slot", "--app", "jobs", "--queue", "send_email", "--burst"])
    assert slot.returncode == 0, slot.stdout + slot.stderr
    assert (tmp_path / "sent.txt").read_text() == "ada@example.com Your order\n"
    state_dir = tmp_path / ".qcluster"
    try:
        with Client(state_dir=state_dir) as client:
            assert client.stats("send_email")["delayed"] == 1  # the busy one, in 30 s
    finally:
        stop_embedded(state_dir)
