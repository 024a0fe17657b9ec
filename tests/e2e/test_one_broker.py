"""One cluster, one broker, and the embedded broker's life: real qcluster processes, each
test in a working directory of its own (the processes left behind are found by their
working directory or command line under it, never by name)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from qcluster import exitcodes
from tests.brokers import free_port
from tests.conftest import QCLUSTER, qcluster_env, wait_until

GOOD_APP = ("import qcluster\napp = qcluster.App('shop')\n\n"
            "@app.queue('emails')\ndef emails(jobs):\n    pass\n")


def processes_under(directory: Path) -> list[str]:
    """Every process whose working directory or command line is under ``directory``."""
    found = []
    root = str(directory.resolve())
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue  # gone, or not ours to read
        if cwd == root or cwd.startswith(root + "/") or root in cmdline:
            found.append(f"{entry.name}: {cmdline.strip()} (cwd {cwd})")
    return found


def env_without_qcluster(**extra: str) -> dict[str, str]:
    return {key: value for key, value in qcluster_env(**extra).items()
            if not key.startswith("QCLUSTER_") or key in extra}


def run(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*QCLUSTER, *args], cwd=directory, env=env_without_qcluster(),
                          capture_output=True, text=True, timeout=120)


def start(directory: Path, log: str, *args: str, **env: str) -> subprocess.Popen[bytes]:
    with (directory / log).open("wb") as out:
        return subprocess.Popen([*QCLUSTER, *args], cwd=directory, stdout=out,
                                stderr=subprocess.STDOUT, env=env_without_qcluster(**env),
                                start_new_session=True)


def stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


def test_stats_in_an_empty_directory_starts_nothing_and_says_so(tmp_path: Path) -> None:
    done = run(tmp_path, "stats")
    assert done.returncode == exitcodes.BROKER_CONNECT
    assert done.stderr.strip() == (f"error: no embedded broker is running in {tmp_path}/.qcluster"
                                   " (start a manager or master here, or give --broker URL / "
                                   "QCLUSTER_BROKER_URL)")
    assert processes_under(tmp_path) == []
    assert not (tmp_path / ".qcluster").exists()


def healthy(port: int) -> bool:
    import httpx

    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_embedded_broker_stops_with_the_last_process_that_uses_it(tmp_path: Path) -> None:
    port = free_port()
    manager = start(tmp_path, "manager.log", "manager", "--listen", f"127.0.0.1:{port}")
    try:
        wait_until(lambda: healthy(port), timeout_s=60, message="the manager answering")
        assert "uses the EMBEDDED broker in" in (tmp_path / "manager.log").read_text()
        enqueued = run(tmp_path, "enqueue", "emails", '{"to": "a@example.org"}')
        assert enqueued.returncode == 0, enqueued.stderr
        status = run(tmp_path, "broker", "status")  # the enqueue's exit did not stop it
        assert status.returncode == 0 and f"process(es) {manager.pid}" in status.stdout
        refused = run(tmp_path, "broker", "stop")
        assert refused.returncode == exitcodes.BROKER_IN_USE, refused.stderr
        assert str(manager.pid) in refused.stderr
    finally:
        code = stop(manager)
    assert code == 0, (tmp_path / "manager.log").read_text()
    assert processes_under(tmp_path) == []  # the manager, its last user, stopped it
    assert run(tmp_path, "broker", "status").returncode == exitcodes.BROKER_CONNECT
    restarted = start(tmp_path, "manager2.log", "manager", "--listen", f"127.0.0.1:{port}")
    try:  # the job enqueued before is still there: the stop saved it
        wait_until(lambda: healthy(port), timeout_s=60, message="the manager answering")
        counts = json.loads(run(tmp_path, "stats", "emails", "--json").stdout)
        assert counts["emails"]["ready"] == 1
    finally:
        stop(restarted)
    assert processes_under(tmp_path) == []


def test_a_master_on_another_broker_than_its_manager_is_refused(
        tmp_path: Path, redis_url: str) -> None:
    (tmp_path / "good_app.py").write_text(GOOD_APP)
    port = free_port()
    manager = start(tmp_path, "manager.log", "manager", "--listen", f"127.0.0.1:{port}",
                    QCLUSTER_BROKER_URL=redis_url)
    try:
        wait_until(lambda: healthy(port), timeout_s=60, message="the manager answering")
        master = run(tmp_path, "master", "--app", "good_app", "--no-metrics",
                     "--listen", str(free_port()), "--host-name", "stray",
                     "--manager", f"http://127.0.0.1:{port}")
    finally:
        stop(manager)
    assert master.returncode == exitcodes.WRONG_BROKER, master.stderr
    last = master.stderr.strip().splitlines()[-1]
    assert last.startswith("error: master stray uses the broker embedded://"
                           f"{tmp_path}/.qcluster, but the manager at http://127.0.0.1:{port} "
                           f"uses {redis_url}: they are different brokers"), last
    assert processes_under(tmp_path) == []  # nor did its embedded broker outlive it


def test_stats_does_not_show_another_clusters_manager_rates_as_its_own(
        tmp_path: Path, redis_url: str) -> None:
    """The manager at the default URL can be another cluster's (a demo on 7300 beside
    --broker PROD): stats listed that manager's queues and rates against its own broker."""
    (tmp_path / "good_app.py").write_text(GOOD_APP)
    port, other_port = free_port(), free_port()
    theirs = "emails"  # the queue their master reports
    manager_url = f"http://127.0.0.1:{port}"
    ours = tmp_path / "ours"
    ours.mkdir()
    local = f"embedded://{ours}/state"
    manager = start(tmp_path, "manager.log", "manager", "--listen", f"127.0.0.1:{port}",
                    QCLUSTER_BROKER_URL=redis_url)
    # a cluster of its own on its embedded broker (its manager keeps the broker up)
    own_manager = start(ours, "manager.log", "manager", "--listen", f"127.0.0.1:{other_port}",
                        QCLUSTER_BROKER_URL=local)
    master = None
    try:
        wait_until(lambda: healthy(port) and healthy(other_port), timeout_s=60,
                   message="both managers answering")
        master = start(tmp_path, "master.log", "master", "--app", "good_app", "--no-metrics",
                       "--listen", str(free_port()), "--manager", manager_url,
                       QCLUSTER_BROKER_URL=redis_url)
        wait_until(lambda: theirs in run(tmp_path, "stats", "--broker", redis_url,
                                         "--manager", manager_url).stdout,
                   timeout_s=60, message="the manager's rates of its own broker")
        assert run(ours, "enqueue", "local-queue", "{}", "--broker", local).returncode == 0
        other = run(ours, "stats", "--broker", local, "--manager", manager_url)
    finally:
        if master is not None:
            stop(master)
        stop(own_manager)
        stop(manager)
    assert other.returncode == 0, other.stderr
    assert theirs not in other.stdout and "local-queue" in other.stdout, other.stdout
    assert (f"no in/out rates: the manager at {manager_url} works on another broker "
            f"({redis_url}, cluster") in other.stdout, other.stdout
