"""The reload template (master/template.py) with real processes: its answer (ready with
the new code's version and policies, or failed with one line), and a slot forked through
it: the slot's parent is the master (a child subreaper), and it dies with the master, as
does the template."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from qcluster.master.template import Failed, Ready, TemplateHandle, TemplateSpec, one_line
from tests.conftest import ROOT, wait_until

GOOD = '''
from qcluster import App

app = App("t", version="{version}")


@app.queue("tq", batch_size=7)
def handle(jobs):
    pass
'''


@pytest.fixture
def app_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    directory = tmp_path / "app"
    directory.mkdir()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(directory), str(ROOT)]))
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    yield directory


def answer(handle: TemplateHandle) -> Ready | Failed:
    try:
        wait_until(lambda: handle.poll() is not None, timeout_s=60, message="an answer")
        result = handle.poll()
        assert result is not None
        return result
    finally:
        handle.end()
        os.waitpid(handle.pid, 0)


def spec(tmp_path: Path, **fields: object) -> TemplateSpec:
    return TemplateSpec.model_validate({
        "app": "tmpl_app", "state_dir": str(tmp_path), "master_pid": os.getpid(),
        "metrics": False, **fields})


def test_ready_carries_the_new_version_and_policies(app_dir: Path, tmp_path: Path) -> None:
    (app_dir / "tmpl_app.py").write_text(GOOD.format(version="v7"))
    result = answer(TemplateHandle(spec(tmp_path, row=["tq"])))
    assert isinstance(result, Ready)
    assert result.version == "v7" and result.queues["tq"].batch_size == 7


@pytest.mark.parametrize(("source", "error"), [
    ("def broken(:\n", "SyntaxError: invalid syntax (tmpl_app.py, line 1)"),
    ("raise RuntimeError('boom\\nsecond line')\n", "RuntimeError: boom second line"),
    ("import sys\nsys.exit(3)\n", "SystemExit: 3"),
    ("x = 1\n", "AppImportError: tmpl_app:app is NoneType, expected a qcluster.App"),
])
def test_any_import_failure_is_one_line(app_dir: Path, tmp_path: Path, source: str,
                                        error: str) -> None:
    (app_dir / "tmpl_app.py").write_text(source)
    result = answer(TemplateHandle(spec(tmp_path)))
    assert isinstance(result, Failed) and result.error == error


def test_a_queue_of_the_row_without_handler_fails(app_dir: Path, tmp_path: Path) -> None:
    (app_dir / "tmpl_app.py").write_text(GOOD.format(version="v1"))
    result = answer(TemplateHandle(spec(tmp_path, row=["tq", "gone"])))
    assert isinstance(result, Failed) and "no handler for queue 'gone'" in result.error


def test_one_line_keeps_type_and_message() -> None:
    assert one_line(ValueError("a\n  b")) == "ValueError: a b"
    assert one_line(KeyError()) == "KeyError: KeyError()"


MASTER = '''
import json, os, sys, time
from qcluster.master.effects import ProcessEffects, become_subreaper
from qcluster.master.template import Ready, TemplateHandle, TemplateSpec
from qcluster.messages import SlotHello

become_subreaper()
spec = TemplateSpec(app="tmpl_app", broker_url=sys.argv[1], state_dir=sys.argv[2],
                    master_pid=os.getpid(), row=["tq"], metrics=False)
handle = TemplateHandle(spec)
while not isinstance(handle.poll(), Ready):
    time.sleep(0.02)
effects = ProcessEffects()
pid = effects.fork_via(handle, "tq", 0)
while not any(isinstance(m, SlotHello) for m in effects.channels.receive(pid)):
    time.sleep(0.02)
print(json.dumps({"slot": pid, "template": handle.pid}), flush=True)
time.sleep(600)
'''


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_slot_forked_through_the_template_is_the_masters_child_and_dies_with_it(
    app_dir: Path, tmp_path: Path, embedded_url: str
) -> None:
    (app_dir / "tmpl_app.py").write_text(GOOD.format(version="v1"))
    master = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(MASTER), embedded_url, str(tmp_path)],
        stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert master.stdout is not None
        line = master.stdout.readline()
        pids = json.loads(line)
        slot, template = pids["slot"], pids["template"]
        assert parent_of(slot) == master.pid  # reparented to the subreaper, not to init
        assert parent_of(template) == master.pid
        # Review finding 8: the slot shares the template's command line; its name differs.
        assert Path(f"/proc/{template}/comm").read_text() == "qc-template\n"
        assert Path(f"/proc/{slot}/comm").read_text() == "qc-slot\n"
        master.send_signal(signal.SIGKILL)
        master.wait()
        wait_until(lambda: not alive(slot) and not alive(template), timeout_s=60,
                   message="slot and template gone with the master")
    finally:
        if master.poll() is None:
            os.killpg(master.pid, signal.SIGKILL)
            master.wait()



def test_the_spec_is_not_on_the_command_line(app_dir: Path, tmp_path: Path) -> None:
    """A broker URL may hold a password: any local user can read a command line."""
    (app_dir / "tmpl_app.py").write_text(GOOD.format(version="v1"))
    handle = TemplateHandle(spec(tmp_path, broker_url="redis://:s3cret@127.0.0.1:1/0"))
    try:
        path = Path(f"/proc/{handle.pid}/cmdline")
        wait_until(lambda: b"qcluster" in path.read_bytes(), timeout_s=60, message="exec")
        cmdline = path.read_bytes()
        assert b"s3cret" not in cmdline and b"qcluster.master.template" in cmdline
    finally:
        assert isinstance(answer(handle), Ready)


def test_a_template_that_does_not_fork_in_time_is_killed(app_dir: Path,
                                                          tmp_path: Path) -> None:
    (app_dir / "tmpl_app.py").write_text("import time\ntime.sleep(30)\n")
    handle = TemplateHandle(spec(tmp_path))
    try:
        a, b = socket.socketpair()
        with a, b:
            assert handle.fork_slot("tq", 0, a.fileno(), b.fileno(), timeout_s=0.5) is None
        _, status = os.waitpid(handle.pid, 0)
        assert os.waitstatus_to_exitcode(status) == -signal.SIGKILL
    finally:
        handle.end()


def test_a_reaped_template_is_never_signalled(app_dir: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Its pid may belong to another process once the master has waited for it."""
    (app_dir / "tmpl_app.py").write_text(GOOD.format(version="v1"))
    handle = TemplateHandle(spec(tmp_path))
    os.kill(handle.pid, signal.SIGKILL)
    os.waitpid(handle.pid, 0)
    handle.reaped = True
    kills: list[int] = []
    monkeypatch.setattr(os, "kill", lambda pid, signum: kills.append(pid))
    handle.end()
    assert kills == [] and handle.ended


def test_the_configuration_is_read_again(app_dir: Path, tmp_path: Path) -> None:
    """[queues.X] overrides follow the code: the template reads qcluster.toml anew."""
    (app_dir / "tmpl_app.py").write_text(GOOD.format(version="v1"))
    config = tmp_path / "qcluster.toml"
    config.write_text("[queues.tq]\nbatch_size = 9\n")
    result = answer(TemplateHandle(spec(tmp_path, config=str(config))))
    assert isinstance(result, Ready) and result.queues["tq"].batch_size == 9
    config.write_text("[queues.tq]\nbatch_size = 0\n")
    result = answer(TemplateHandle(spec(tmp_path, config=str(config))))
    assert isinstance(result, Failed) and "queues.tq.batch_size" in result.error


def test_without_memfd_the_take_is_still_shared_through_fork(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """A seccomp filter may refuse memfd_create: the in-master fork path keeps working
    (an anonymous shared mapping); only a template's slot cannot follow its take."""
    from qcluster.channel import TakeProgress

    def refused(name: str, flags: int = 0) -> int:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "memfd_create", refused)
    progress = TakeProgress()
    assert progress.fd is None
    progress.states[0] = 3
    pid = os.fork()
    if pid == 0:
        progress.states[1] = 4  # the child's store is seen by the parent
        os._exit(0)
    os.waitpid(pid, 0)
    assert bytes(progress.states[:2]) == b"\x03\x04"


MANY = '''
from qcluster import App

app = App("t", version="many")


def handle(jobs):
    pass


for n in range(1000):
    app.queue(f"q{n:04d}_" + "x" * 90, batch_size=n % 50 + 1)(handle)
'''


def test_a_ready_with_1000_queues_policies_is_read(app_dir: Path, tmp_path: Path) -> None:
    """Review finding 4: ~170 queues' policies exceeded one 64 KiB packet ("the
    template's answer is not readable"): an app with 200 queues could never reload. The
    row (1000 names of 96 characters, ~100 KB) goes over in parts too."""
    (app_dir / "tmpl_app.py").write_text(MANY)
    row = [f"q{n:04d}_" + "x" * 90 for n in range(1000)]
    result = answer(TemplateHandle(spec(tmp_path, row=row)))
    assert isinstance(result, Ready), result
    assert len(result.queues) == 1000 and result.queues[row[999]].batch_size == 50


def test_a_template_that_cannot_be_spawned_leaves_no_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_process(*args: object) -> int:
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(os, "posix_spawn", no_process)
    before = len(os.listdir("/proc/self/fd"))
    errors = []  # kept, as a caller holding the traceback would: its frames stay alive
    for _ in range(20):
        with pytest.raises(OSError) as error:
            TemplateHandle(spec(tmp_path))
        errors.append(error)
    assert len(os.listdir("/proc/self/fd")) == before
