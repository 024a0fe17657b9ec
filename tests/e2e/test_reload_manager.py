"""A rolling reload through the manager, end to end: a real ``qcluster manager``, two real
``qcluster master`` processes (distinct --host-name) on a private Redis, the real CLI.

The app's version comes from a file beside it; the test changes it and runs ``qcluster
reload --all --wait``: both hosts end on generation 1 with the new version, and the two
were never loading or rolling at the same time (polled from /api/v1/cluster all along).
The manager is then killed and started again: it forgets the reload ids and no master
reloads. Then the app is broken (it raises on import) and a new rollout runs: the first
host fails, the rollout stops with exit 13 and the second host is not asked (it keeps
generation 1)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from tests.conftest import QCLUSTER, ROOT, free_port, qcluster_env, wait_until
from tests.e2e.cluster import Procs, try_json

TOKEN = "e2e-reload-2d4f6a8c0e1b3d5f"
INTERVAL = "0.5"
APP = '''\
import time
from pathlib import Path

from qcluster import App

VERSION = (Path(__file__).parent / "version.txt").read_text().strip()
app = App("reload-e2e", version=VERSION)


@app.queue("{queue}", batch_size=5, min_slots=2, max_slots=4)
def work(jobs):
    time.sleep(0.01)
'''


def hosts_code(port: int) -> dict[str, dict[str, Any]]:
    view = try_json(port, "/api/v1/cluster") or {"hosts": []}
    return {h["name"]: h["code"] for h in view["hosts"] if h["alive"]}


def reload_all(port: int) -> subprocess.CompletedProcess[str]:
    env = qcluster_env(QCLUSTER_TOKEN=TOKEN, QCLUSTER_MANAGER_URL=f"http://127.0.0.1:{port}")
    return subprocess.run([*QCLUSTER, "reload", "--all", "--wait", "--timeout", "150"], env=env,
                          capture_output=True, text=True, timeout=240)


def start_manager(procs: Procs, redis_url: str, port: int) -> subprocess.Popen[bytes]:
    manager = procs.start("manager", "manager", "--broker", redis_url, "--listen",
                          f"127.0.0.1:{port}", "--interval", INTERVAL)
    wait_until(lambda: try_json(port, "/healthz") or manager.poll() is not None,
               message="manager up")
    assert manager.poll() is None, procs.log("manager")
    return manager


class Watcher(threading.Thread):
    """Polls the manager's view of the hosts' code until stopped."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.samples: list[dict[str, str]] = []
        """Each poll: host -> its code's reload state."""
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.1):
            self.samples.append({h: c["state"] for h, c in hosts_code(self.port).items()})


def test_reload_all_one_host_at_a_time_then_a_broken_app_stops(redis_url: str,
                                                               tmp_path: Path) -> None:
    suffix = uuid.uuid4().hex[:8]
    queue, hosts = f"reload-{suffix}", (f"ra-{suffix}", f"rb-{suffix}")
    code_dir = tmp_path / "code"
    code_dir.mkdir()
    module = f"reload_app_{suffix}"
    (code_dir / f"{module}.py").write_text(APP.format(queue=queue))
    (code_dir / "version.txt").write_text("v1\n")
    procs = Procs(tmp_path, {"QCLUSTER_TOKEN": TOKEN,
                             "PYTHONPATH": os.pathsep.join([str(ROOT), str(code_dir)])})
    port = free_port()
    try:
        manager = start_manager(procs, redis_url, port)
        for host in hosts:
            procs.start(f"master-{host}", "master", "--app", module, "--broker", redis_url,
                        "--manager", f"http://127.0.0.1:{port}", "--host-name", host,
                        "--listen", f"127.0.0.1:{free_port()}")
        wait_until(lambda: {h: c["version"] for h, c in hosts_code(port).items()}
                   == dict.fromkeys(hosts, "v1"), message="both masters report v1")

        (code_dir / "version.txt").write_text("v2\n")
        watcher = Watcher(port)
        watcher.start()
        done = reload_all(port)
        watcher.stop.set()
        watcher.join()
        assert done.returncode == 0, done.stdout + done.stderr + procs.log(f"master-{hosts[0]}")
        for host in hosts:
            assert f"{host}: took, version v1 -> v2, generation 1" in done.stdout
        code = hosts_code(port)
        assert {h: (c["version"], c["generation"], c["state"]) for h, c in code.items()} == \
            dict.fromkeys(hosts, ("v2", 1, "idle"))
        busy = [sum(state in ("loading", "rolling") for state in sample.values())
                for sample in watcher.samples]
        assert busy and max(busy) <= 1, watcher.samples  # never both at once
        rollout = try_json(port, "/api/v1/reload")
        first, second = rollout["hosts"]
        assert second["asked_at"] >= first["ended_at"]

        # A restarted manager forgets every reload id and sends "": no master reloads.
        os.killpg(manager.pid, signal.SIGKILL)
        manager.wait()
        manager = start_manager(procs, redis_url, port)
        wait_until(lambda: set(hosts_code(port)) == set(hosts), message="both report again")
        deadline = time.monotonic() + 3.0  # six report intervals
        while time.monotonic() < deadline:
            assert {(c["generation"], c["state"]) for c in hosts_code(port).values()} \
                <= {(1, "idle")}
            time.sleep(0.1)
        assert try_json(port, "/api/v1/reload") is None

        (code_dir / f"{module}.py").write_text(
            APP.format(queue=queue) + '\nraise ImportError("v3 is broken")\n')
        (code_dir / "version.txt").write_text("v3\n")
        failed = reload_all(port)
        assert failed.returncode == 13, failed.stdout + failed.stderr
        assert "v3 is broken" in failed.stdout + failed.stderr
        code = hosts_code(port)
        assert code[hosts[0]]["state"] == "failed" and "v3 is broken" in code[hosts[0]]["error"]
        assert code[hosts[1]]["generation"] == 1 and code[hosts[1]]["state"] == "idle"
        stopped = try_json(port, "/api/v1/reload")
        assert [h["state"] for h in stopped["hosts"]] == ["failed", "waiting"]
        # The failed host's old slots keep serving: it still runs its slots.
        view = try_json(port, "/api/v1/cluster")
        assert sum(sum(h["slots"].values()) for h in view["hosts"]) >= 2
    finally:
        procs.stop_all()
