"""Shared fixtures: real brokers, unique queue names, running qcluster processes.

Real services: Redis at 127.0.0.1:6379, RabbitMQ at 127.0.0.1:5672 (guest/guest), and
the embedded broker (started here in a private state directory). Under ``CI=true`` an
unreachable broker fails the test; elsewhere it is skipped with the reason.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REDIS_URL = os.environ.get("QCLUSTER_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
RABBITMQ_URL = os.environ.get("QCLUSTER_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
ROOT = Path(__file__).resolve().parent.parent
QCLUSTER = [sys.executable, "-m", "qcluster"]


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def require_service(name: str, host: str, port: int) -> None:
    if _reachable(host, port):
        return
    message = f"{name} is not reachable at {host}:{port}"
    if IN_CI:
        pytest.fail(message + " (CI=true: a missing broker is a failure, not a skip)")
    pytest.skip(message)


@pytest.fixture(scope="session")
def redis_url() -> str:
    require_service("Redis", "127.0.0.1", 6379)
    return REDIS_URL


@pytest.fixture(scope="session")
def rabbitmq_url() -> str:
    require_service("RabbitMQ", "127.0.0.1", 5672)
    return RABBITMQ_URL


@pytest.fixture(scope="session")
def embedded_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from qcluster.broker.embedded import ensure_server, stop_embedded

    state_dir = tmp_path_factory.mktemp("embedded-state")
    ensure_server(state_dir)
    yield f"embedded://{state_dir}"
    stop_embedded(state_dir)


BACKENDS = ["redis", "embedded", "rabbitmq"]


@pytest.fixture(params=BACKENDS)
def broker_url(request: pytest.FixtureRequest) -> str:
    """Each test using this runs once per backend."""
    fixture = {"redis": "redis_url", "embedded": "embedded_url", "rabbitmq": "rabbitmq_url"}
    return str(request.getfixturevalue(fixture[request.param]))


@pytest.fixture
def queue_name(request: pytest.FixtureRequest) -> str:
    """A queue name no other test (or engineer) uses at the same time."""
    return f"t-{request.node.name[:30]}-{uuid.uuid4().hex[:8]}".replace("[", "-").replace("]", "")


def wait_until(
    predicate: Callable[[], object], *, timeout_s: float = 10.0, interval_s: float = 0.05,
    message: str = "condition",
) -> None:
    """Poll ``predicate`` until truthy or fail after ``timeout_s`` (monotonic clock)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:g}s waiting for {message}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def qcluster_env(**extra: str) -> dict[str, str]:
    """Environment for child qcluster processes: the tests' apps are importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.pop("QCLUSTER_BROKER_URL", None)
    env.update(extra)
    return env


def start_qcluster(*args: str, cwd: Path | None = None, **env: str) -> subprocess.Popen[bytes]:
    """Start ``python -m qcluster ARGS`` as a real process (its own process group)."""
    return subprocess.Popen(
        [*QCLUSTER, *args], cwd=cwd or ROOT, env=qcluster_env(**env),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
