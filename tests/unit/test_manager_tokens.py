"""Named tokens at the manager's start: ``[tokens]`` without the unnamed ``token`` is
refused in one line (masters report with ``token`` only: every report would be refused),
and a ``[tokens]`` entry named ``token`` is refused when the settings load (the unnamed
token is shown by that name and silently replaced it)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from qcluster.config import load_settings
from qcluster.errors import ConfigError
from qcluster.exitcodes import CONFIG
from tests.conftest import QCLUSTER, free_port

SECRET = "0123456789abcdef0123456789"


def start_manager(config: Path) -> tuple[int, str]:
    """``qcluster manager --config CONFIG`` as a process; a manager that starts instead of
    refusing is stopped after a minute (and the test fails)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("QCLUSTER_TOKEN", "QCLUSTER_TOKENS", "QCLUSTER_CONFIG")}
    port = free_port()
    try:
        done = subprocess.run([*QCLUSTER, "manager", "--config", str(config),
                               "--listen", str(port), "--broker", "redis://127.0.0.1:1"],
                              env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the manager started instead of refusing its configuration")
    return done.returncode, done.stdout + done.stderr


def test_named_tokens_without_the_unnamed_token_refuse_the_manager(tmp_path: Path) -> None:
    config = tmp_path / "qcluster.toml"
    config.write_text(f'[tokens]\nalice = "{SECRET}"\n')
    code, output = start_manager(config)
    assert code == CONFIG, output
    assert "masters report with `token`; set it too" in output
    assert SECRET not in output


def test_a_named_token_called_token_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "qcluster.toml"
    config.write_text(f'token = "{SECRET}x"\n[tokens]\ntoken = "{SECRET}"\n')
    with pytest.raises(ConfigError, match='name "token" is the unnamed') as refused:
        load_settings(config)
    assert SECRET not in str(refused.value)
