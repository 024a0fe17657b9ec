"""Issue 15, defect 10: a ``[queues.X]`` override that breaks the policy rules is refused
when the configuration is loaded (file, queue, field and reason), not at the first planning
round, where it made ``/`` and ``/api/v1/cluster`` answer 500."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from qcluster.config import load_settings
from qcluster.errors import ConfigError
from tests.conftest import QCLUSTER, ROOT, qcluster_env


def write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "qcluster.toml"
    path.write_text(body)
    return path


@pytest.mark.parametrize(("body", "field"), [
    ("lock_timeout = 5\nbatch_timeout = 10", "lock_timeout"),
    ("min_slots = 5\nmax_slots = 2", "min_slots"),
    ("batch_size = 0", "batch_size"),
    ("lock_timeout = nan", "lock_timeout"),
])
def test_bad_queue_override_is_refused_at_load(tmp_path: Path, body: str, field: str) -> None:
    path = write(tmp_path, f"[queues.mail]\n{body}\n")
    with pytest.raises(ConfigError) as refused:
        load_settings(path)
    message = str(refused.value)
    assert str(path) in message and "queues.mail" in message and field in message


def test_one_timeout_alone_is_accepted(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, "[queues.mail]\nlock_timeout = 5\n"))
    assert settings.queues["mail"] == {"lock_timeout": 5}


def test_manager_refuses_to_start_with_a_bad_override(tmp_path: Path) -> None:
    path = write(tmp_path, "[queues.mail]\nlock_timeout = 5\nbatch_timeout = 10\n")
    done = subprocess.run([*QCLUSTER, "manager", "--config", str(path)], cwd=ROOT,
                          env=qcluster_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    assert "queues.mail" in done.stderr and "lock_timeout" in done.stderr
