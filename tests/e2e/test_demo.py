"""`qcluster demo` (what `make demo` runs) as a real process, until its cluster runs."""

from __future__ import annotations

import re
import signal
import subprocess
import threading
from pathlib import Path

from tests.brokers import free_port_run
from tests.conftest import QCLUSTER, ROOT, qcluster_env, wait_until
from tests.e2e.test_one_broker import processes_under


def test_demo_runs_a_cluster_and_stops_cleanly(tmp_path: Path) -> None:
    port = free_port_run(3)  # the manager, then one port per master
    demo = subprocess.Popen(
        [*QCLUSTER, "demo", "--port", str(port), "--state-dir", str(tmp_path / "state")],
        cwd=ROOT, env=qcluster_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []

    def read() -> None:
        assert demo.stdout is not None
        for line in demo.stdout:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def cluster_running() -> bool:
        # Until both masters reported and slots run (a fixed run time failed on a busy CPU).
        text = "".join(lines)
        return "hosts 2" in text and any(
            int(n) > 0 for n in re.findall(r"(\d+)/\d+\s+slots", text))

    try:
        wait_until(cluster_running, timeout_s=150, message="both masters reporting, slots up")
    except AssertionError as waited:
        logs = "".join(f"\n--- {log.name}\n{log.read_text()[-3000:]}"
                       for log in sorted((tmp_path / "state").rglob("*.log")))
        raise AssertionError(f"{waited}\n--- demo output\n{''.join(lines)[-3000:]}{logs}") from None
    finally:
        demo.send_signal(signal.SIGINT)  # Ctrl-C
        demo.wait(timeout=90)
        reader.join(timeout=30)
    output = "".join(lines)
    assert demo.returncode == 0, output
    assert f"http://127.0.0.1:{port}/" in output
    assert "hosts 2" in output  # both masters reported to the manager
    assert "resize" in output and "slots" in output
    assert "demo stopped after enqueuing" in output
    assert "qcluster simulate --trace " in output  # the run was recorded for a replay
    assert f"http://127.0.0.1:{port}/login?code=" in output  # its buttons work (one-time login)
    leftovers = subprocess.run(["pgrep", "-f", f"127.0.0.1:{port}"], capture_output=True)
    assert leftovers.stdout == b"", "a demo process outlived the demo"
    # nor its embedded broker: no process left whose command line names its state directory
    assert processes_under(tmp_path) == []
