"""`qcluster demo` (what `make demo` runs) as a real process, for a scripted 25 s."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.conftest import QCLUSTER, ROOT, free_port, qcluster_env


def test_demo_runs_a_cluster_and_stops_cleanly(tmp_path: Path) -> None:
    port = free_port()
    done = subprocess.run(
        [*QCLUSTER, "demo", "--duration", "25", "--port", str(port),
         "--state-dir", str(tmp_path / "state")],
        cwd=ROOT, env=qcluster_env(), capture_output=True, text=True, timeout=120,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert f"http://127.0.0.1:{port}/" in output
    assert "hosts 2" in output  # both masters reported to the manager
    assert "resize" in output and "slots" in output
    running = [int(n) for n in re.findall(r"(\d+)/\d+\s+slots", output)]
    assert any(n > 0 for n in running), output  # the cluster API showed slots running
    assert "demo stopped after enqueuing" in output
    assert "qcluster simulate --trace " in output  # the run was recorded for a replay
    leftovers = subprocess.run(["pgrep", "-f", f"127.0.0.1:{port}"], capture_output=True)
    assert leftovers.stdout == b"", "a demo process outlived the demo"
