"""Shared fixtures: real brokers, unique queue names, running qcluster processes.

The suite starts its own brokers (tests/brokers.py), once per session and only when a test
asks for one: a Redis server and a RabbitMQ node on free loopback ports, with their data
under the session's temporary directory, and the embedded broker in a private state
directory. The Redis and RabbitMQ a user may run on 6379/5672 are never touched. To run
the suite against an existing broker instead, set ``QCLUSTER_TEST_REDIS_URL`` /
``QCLUSTER_TEST_RABBITMQ_URL``. A broker that cannot start fails the tests that need it,
naming what to install: nothing is skipped.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tests.brokers import BrokerUnavailable, PrivateBrokers
from tests.brokers import free_port as free_port  # re-exported: tests import it from here

EXISTING_REDIS_URL = os.environ.get("QCLUSTER_TEST_REDIS_URL", "")
EXISTING_RABBITMQ_URL = os.environ.get("QCLUSTER_TEST_RABBITMQ_URL", "")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
ROOT = Path(__file__).resolve().parent.parent
QCLUSTER = [sys.executable, "-m", "qcluster"]
# Property tests check properties, not speed: no per-example deadline, no "too slow" health
# check, which a saturated CPU would fail. A test's own @settings still overrides these.
settings.register_profile(
    "qcluster", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("qcluster")

#: The session's private brokers (for the summary line and ``rabbitmqctl``).
SESSION_BROKERS: list[PrivateBrokers] = []


def pytest_report_header() -> list[str]:
    redis = EXISTING_REDIS_URL or "private redis-server (started on first use)"
    rabbitmq = EXISTING_RABBITMQ_URL or "private RabbitMQ node (started on first use)"
    return [f"brokers: {redis}; {rabbitmq}"]


#: What each pytest-xdist worker started (it sends its summary when it ends).
WORKER_BROKERS: list[str] = []


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A pytest-xdist worker sends its brokers' summary to the controller, whose last line
    names them: with ``-n 2`` (``make test``) the controller starts none itself."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "worker")
        workeroutput["qcluster_brokers"] = [f"{worker}: {brokers.summary()}"
                                            for brokers in SESSION_BROKERS]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    WORKER_BROKERS.extend(getattr(node, "workeroutput", {}).get("qcluster_brokers", []))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    started = "; ".join([*(brokers.summary() for brokers in SESSION_BROKERS),
                         *WORKER_BROKERS])
    existing = [f"existing {url}" for url in (EXISTING_REDIS_URL, EXISTING_RABBITMQ_URL) if url]
    terminalreporter.write_line("brokers: " + ("; ".join(filter(None, [started, *existing]))
                                               or "none used"))


#: Files whose tests each run real processes for a minute or more on a loaded machine. They
#: run first: with ``-n 2 --dist worksteal`` each worker takes half of the collection in
#: order and an idle worker steals from the end of the other's share, so a long test placed
#: late could start last and hold one worker alone while the other has finished.
LONG_FIRST = (
    "tests/e2e/test_demo_planning.py",
    "tests/e2e/test_controls.py",
    "tests/test_packaging.py",
    "tests/e2e/test_fleet_page.py",
    "tests/contract/test_core_hardening.py",
    "tests/e2e/test_tutorial.py",
    "tests/browser/test_local_login.py",
    "tests/e2e/test_job_lookup.py",
    "tests/e2e/test_newcomer_mistakes.py",
    "tests/e2e/test_one_broker.py",
    "tests/e2e/test_reload.py",
    "tests/e2e/test_manager.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The LONG_FIRST files first (in that order), the rest in their collection order."""
    rank = {path: index for index, path in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    """A test that leaves an event loop marked running in its thread (a loop interrupted in
    ``run_until_complete``, a Playwright session left open) fails here, by name. Left
    behind, it would fail an unrelated later test of the same worker, one that runs a loop
    of its own (``asyncio.run``, a slot's ``asyncio.Runner``): "cannot be called from a
    running event loop". Checked once the test's fixtures are torn down; the mark is then
    cleared, so that the next tests run as if it had not leaked."""
    try:
        return (yield)
    finally:
        leaked = asyncio.events._get_running_loop()
        if leaked is not None:
            asyncio.events._set_running_loop(None)
            pytest.fail(f"{item.nodeid} left an event loop marked running in its thread "
                        f"({leaked!r}): a later test's asyncio.run would refuse to run",
                        pytrace=False)


@pytest.fixture(scope="session")
def private_brokers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateBrokers]:
    """The session's own servers; each starts when first asked for, all stop at the end."""
    brokers = PrivateBrokers(tmp_path_factory.mktemp("brokers"))
    SESSION_BROKERS.append(brokers)
    try:
        yield brokers
    finally:
        brokers.stop()


def _started(start: Callable[[], str]) -> str:
    try:
        return start()
    except BrokerUnavailable as error:
        reason = str(error)
    pytest.fail(reason, pytrace=False)  # outside the except: the reason alone, once


@pytest.fixture(scope="session")
def redis_url(private_brokers: PrivateBrokers) -> str:
    return EXISTING_REDIS_URL or _started(private_brokers.redis_url)


@pytest.fixture(scope="session")
def rabbitmq_url(private_brokers: PrivateBrokers) -> str:
    return EXISTING_RABBITMQ_URL or _started(private_brokers.rabbitmq_url)


def rabbitmqctl(*args: str) -> str:
    """Output of ``rabbitmqctl ARGS`` run against the node ``rabbitmq_url`` points at."""
    for brokers in SESSION_BROKERS:
        if brokers.rabbitmq is not None:
            return brokers.rabbitmq.ctl(*args).stdout
    return subprocess.run(["rabbitmqctl", *args], capture_output=True, text=True,
                          check=True).stdout


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
    """A queue name no other test (or test run) uses at the same time."""
    return f"t-{request.node.name[:30]}-{uuid.uuid4().hex[:8]}".replace("[", "-").replace("]", "")


#: The default wait before ``wait_until`` declares failure. A deadline only decides when a
#: test gives up: with both CPUs saturated by other work, a step that takes 0.1 s alone can
#: take 20 times longer, and a passing test never waits longer for a generous one. So the
#: waits in the tests are a minute or more, and the number a test gives is the one used.
GENEROUS_WAIT_S = 60.0


def wait_until(
    predicate: Callable[[], object], *, timeout_s: float = GENEROUS_WAIT_S,
    interval_s: float = 0.05, message: str = "condition",
) -> None:
    """Poll ``predicate`` until truthy or fail after ``timeout_s`` (monotonic clock): it is
    a condition to wait for, not a speed to assert."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:g}s waiting for {message}")


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


# The Chromium fixtures (``chromium``, ``browser``, ``page``), registered here once for the
# browser tests and the end-to-end tests that open a page: one Playwright session per session.
from tests.browser.chromium import browser, chromium, page  # noqa: E402, F401
