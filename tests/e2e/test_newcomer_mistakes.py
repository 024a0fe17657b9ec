"""The mistakes a newcomer makes, each one ending in one line and a documented exit code
(qcluster/exitcodes.py), never a traceback, an empty table or silence: real ``qcluster``
commands in subprocesses, in an empty working directory of their own."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from qcluster import exitcodes
from tests.brokers import free_port
from tests.conftest import QCLUSTER, qcluster_env

APP_FILES = {
    "syntax_app.py": "import qcluster\n\ndef broken(:\n    pass\n",
    "raising_app.py": "import qcluster\nraise RuntimeError('database not configured')\n",
    "importing_app.py": "import a_module_nobody_installed\n",
    "good_app.py": ("import qcluster\napp = qcluster.App('shop')\n\n"
                    "@app.queue('emails')\ndef emails(jobs):\n    pass\n"),
    "bad.toml": "[manager\nlisten = 1\n",
    "app.toml": 'app = "good_app"\n',
}
TAKEN = "TAKEN"  # replaced by a port this module holds
FREE = "FREE"  # replaced by a port nothing listens on


@dataclass(frozen=True)
class Mistake:
    args: tuple[str, ...]
    code: int
    says: str
    env: dict[str, str] = field(default_factory=dict)


MISTAKES = {
    "stats, no broker running": Mistake(
        ("stats",), exitcodes.BROKER_CONNECT, "no embedded broker is running"),
    "dead, no broker running": Mistake(
        ("dead", "emails"), exitcodes.BROKER_CONNECT, "no embedded broker is running"),
    "stats, unreachable --broker": Mistake(
        ("stats", "--broker", "redis://127.0.0.1:FREE/0"), exitcodes.BROKER_CONNECT,
        "unreachable"),
    "broker status, none running": Mistake(
        ("broker", "status"), exitcodes.BROKER_CONNECT, "no embedded broker is running"),
    "syntax error in the app": Mistake(
        ("master", "--app", "syntax_app", "--no-metrics", "--listen", "FREE"),
        exitcodes.APP_IMPORT, "syntax_app.py:3: invalid syntax"),
    "the app raises on import": Mistake(
        ("master", "--app", "raising_app", "--no-metrics", "--listen", "FREE"),
        exitcodes.APP_IMPORT, "raising_app.py:2: RuntimeError: database not configured"),
    "the app imports a missing module": Mistake(
        ("master", "--app", "importing_app", "--no-metrics", "--listen", "FREE"),
        exitcodes.APP_IMPORT, "No module named 'a_module_nobody_installed'"),
    "mod:attr missing": Mistake(
        ("master", "--app", "good_app:ap", "--no-metrics", "--listen", "FREE"),
        exitcodes.APP_IMPORT, "module 'good_app' has no attribute 'ap' (qcluster.App objects "
                              "in it: app)"),
    # `qcluster slot` printed the import's traceback and exited 1 for the first two.
    "syntax error in the app, slot": Mistake(
        ("slot", "--app", "syntax_app", "--queue", "emails"),
        exitcodes.APP_IMPORT, "syntax_app.py:3: invalid syntax"),
    "the app raises on import, slot": Mistake(
        ("slot", "--app", "raising_app", "--queue", "emails"),
        exitcodes.APP_IMPORT, "raising_app.py:2: RuntimeError: database not configured"),
    "mod:attr missing, slot": Mistake(
        ("slot", "--app", "good_app:ap", "--queue", "emails"),
        exitcodes.APP_IMPORT, "module 'good_app' has no attribute 'ap'"),
    # A missing --file ended in a FileNotFoundError traceback (exit 1).
    "enqueue --file that does not exist": Mistake(
        ("enqueue", "emails", "--file", "jobs.jsonl"), exitcodes.USAGE,
        "--file jobs.jsonl: cannot read: No such file or directory"),
    # Printed over two lines (rich folds stderr at 80 columns when it is not a terminal).
    "dead --delete without ids": Mistake(
        ("dead", "emails", "--delete"), exitcodes.USAGE,
        "give IDS with --delete (and optionally with --requeue), and --requeue or --delete "
        "with IDS"),
    # It said the folder "does not exist".
    "--config a folder": Mistake(
        ("stats", "--config", "."), exitcodes.CONFIG,
        "configuration file '.' is a folder: give the qcluster.toml file in it"),
    # Exit 6 (a configuration error) and exit 3 (no handler for 'bad name'): both are a
    # bad command line, exit 2 (docs/reference.md, "Exit codes").
    "--slots not QUEUE=N": Mistake(
        ("master", "--app", "good_app", "--no-metrics", "--listen", "FREE", "--slots",
         "emails=x"), exitcodes.USAGE, "--slots: expected QUEUE=N[,QUEUE=N...], got 'emails=x'"),
    "--slots with a queue name outside the rule": Mistake(
        ("master", "--app", "good_app", "--no-metrics", "--listen", "FREE", "--slots",
         "bad name=1"), exitcodes.USAGE, "invalid queue name 'bad name'"),
    # An OverflowError traceback from bind() (exit 1).
    "demo --port out of range": Mistake(
        ("demo", "--port", "70000"), exitcodes.USAGE,
        "--port: the manager takes P and the masters P+1 and P+2: give a P from 1 to 65533"),
    "master port in use": Mistake(
        ("master", "--app", "good_app", "--no-metrics", "--listen", "TAKEN"),
        exitcodes.ADDRESS_IN_USE, "already in use (another qcluster process?): choose "
                                  "another port with --listen"),
    "manager port in use": Mistake(
        ("manager", "--listen", "TAKEN"), exitcodes.ADDRESS_IN_USE, "with --listen"),
    "--host-auto and --slots": Mistake(
        ("master", "--app", "good_app", "--host-auto", "--slots", "emails=1"),
        exitcodes.USAGE, "--host-auto and --slots: give one"),
    "bad TOML": Mistake(
        ("stats", "--config", "bad.toml"), exitcodes.CONFIG, "bad.toml: not valid TOML"),
    "QCLUSTER_TOKENS not JSON, manager": Mistake(
        ("manager", "--listen", "FREE"), exitcodes.CONFIG,
        "QCLUSTER_TOKENS is not valid JSON", {"QCLUSTER_TOKENS": "{ops: abc"}),
    "QCLUSTER_TOKENS not JSON, pause": Mistake(
        ("pause", "emails"), exitcodes.CONFIG, "QCLUSTER_TOKENS is not valid JSON",
        {"QCLUSTER_TOKENS": "[1, 2"}),
    "QCLUSTER_TOKENS not JSON, controls": Mistake(
        ("controls",), exitcodes.CONFIG, "QCLUSTER_TOKENS is not valid JSON",
        {"QCLUSTER_TOKENS": "ops=abc"}),
    "QCLUSTER_QUEUE_TYPE not a type": Mistake(
        ("stats",), exitcodes.CONFIG, "QCLUSTER_QUEUE_TYPE", {"QCLUSTER_QUEUE_TYPE": "durable"}),
    "QCLUSTER_MANAGER field not a number": Mistake(
        ("manager",), exitcodes.CONFIG, "manager.interval_s",
        {"QCLUSTER_MANAGER": '{"interval_s": "fast"}'}),
    "a public bind without a token": Mistake(
        ("manager", "--listen", "0.0.0.0:FREE"), exitcodes.CONFIG, "without a token"),
    "enqueue to a misspelt queue": Mistake(
        ("enqueue", "--config", "app.toml", "emals", "{}"), exitcodes.USAGE,
        "no queue of the app is named 'emals' (did you mean emails?)"),
}


@pytest.fixture(scope="module")
def taken_port() -> Iterator[int]:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


@pytest.mark.parametrize("name", list(MISTAKES))
def test_a_newcomer_mistake_is_one_line_and_its_exit_code(
        name: str, tmp_path: Path, taken_port: int) -> None:
    mistake = MISTAKES[name]
    for file, text in APP_FILES.items():
        (tmp_path / file).write_text(text)
    args = [arg.replace(TAKEN, str(taken_port)).replace(FREE, str(free_port()))
            for arg in mistake.args]
    env = {key: value for key, value in qcluster_env(**mistake.env).items()
           if not key.startswith("QCLUSTER_") or key in mistake.env}
    done = subprocess.run([*QCLUSTER, *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    output = (done.stdout + done.stderr).strip()
    assert done.returncode == mistake.code, output
    assert len(output.splitlines()) == 1, output
    assert output.startswith("error: ") and mistake.says in output, output
    assert not (tmp_path / ".qcluster" / "redis.sock").exists(), "a broker was started"
