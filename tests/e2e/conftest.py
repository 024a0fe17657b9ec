"""Fixtures of the end-to-end tests that run real masters with the test apps
(tests/e2e/*_app.py): a queue-name prefix of their own, the directory the apps log their
runs to, and the processes, stopped at the end."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cluster import Procs


@pytest.fixture
def prefix() -> str:
    return f"e{uuid.uuid4().hex[:8]}"


@pytest.fixture
def logs(tmp_path: Path) -> Path:
    path = tmp_path / "runs"
    path.mkdir()
    return path


@pytest.fixture
def procs(tmp_path: Path, prefix: str, logs: Path) -> Iterator[Procs]:
    running = Procs(tmp_path, {"QC_TEST_PREFIX": prefix, "QC_TEST_LOG_DIR": str(logs),
                               "QCLUSTER_METRICS_DIR": str(tmp_path / "metrics")})
    yield running
    running.stop_all()
