"""Fixtures of the chaos suite: the seed, the broker of a row, and a :class:`ChaosRun`
(real qcluster processes running ``tests.chaos.apps``, a ledger, a producer).

A row looks like::

    @pytest.mark.parametrize("chaos_broker", R_BROKERS, indirect=True)
    def test_row(chaos: ChaosRun) -> None:
        port = chaos.start_master(f"{chaos.q('flow')}=2")
        chaos.producer.enqueue(chaos.q("flow"), 1000)
        rng = chaos.rng            # the fault schedule comes from here (seeded)
        ...                        # inject faults, count them
        chaos.wait_drained([chaos.q("flow")])
        result = chaos.finish("F1", [chaos.q("flow")], faults=kills)
        assert result.lost == 0 ...

``chaos.finish`` stops every process, adds up the ledger, measures the residue, prints
(and under ``QC_CHAOS_RESULTS=1`` keeps) the row's JSON line, deletes the row's queues and
returns the :class:`~tests.chaos.rows.RowResult`.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from qcluster import Client
from tests.chaos import apps
from tests.chaos.ledger import LEDGER_ENV, Ledger, LedgerReport, Producer, dead_letters, residue
from tests.chaos.rows import EMITTED, RowResult, emit, new_seed, profile
from tests.conftest import free_port, wait_until
from tests.e2e.cluster import Procs, get_json

APP = "tests.chaos.apps"
#: Brokers of a row: every row runs on the embedded broker; rows marked R also on RabbitMQ.
EMBEDDED = ["embedded"]
R_BROKERS = ["embedded", "rabbitmq"]


def pytest_addoption(parser: pytest.Parser) -> None:
    # Only seen when pytest is started on tests/chaos (or a file in it); QC_CHAOS_SEED works
    # from anywhere.
    parser.addoption("--chaos-seed", default=None,
                     help="seed of the chaos rows' fault schedules (default: random, printed)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "chaos: a chaos row outside make test (run by make chaos)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Non-core rows (``@pytest.mark.chaos``) run under ``make chaos``
    (``QC_CHAOS_PROFILE=full``) or when asked for by ``-m``; elsewhere they are skipped
    with that reason, whatever the Makefile's marker expression says."""
    if profile() == "full" or "chaos" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="chaos row: runs under make chaos (QC_CHAOS_PROFILE=full)")
    for item in items:
        if item.get_closest_marker("chaos") is not None:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if EMITTED:
        terminalreporter.section(f"chaos rows ({profile()} profile)")
        for result in EMITTED:
            terminalreporter.write_line(result.line())


@pytest.fixture
def chaos_seed(request: pytest.FixtureRequest) -> int:
    """The row's seed: ``--chaos-seed``, else ``QC_CHAOS_SEED``, else random; printed."""
    option = None
    with suppress(ValueError):
        option = request.config.getoption("--chaos-seed")
    seed = new_seed(option)
    print(f"chaos seed {seed} (replay: QC_CHAOS_SEED={seed} pytest '{request.node.nodeid}')")
    request.node.user_properties.append(("chaos_seed", seed))
    return seed


@dataclass
class ChaosBroker:
    name: str  # embedded, redis, rabbitmq, rabbitmq-quorum (every queue a quorum queue)
    url: str


@pytest.fixture(params=EMBEDDED)
def chaos_broker(request: pytest.FixtureRequest) -> ChaosBroker:
    """The broker of a row; parametrize ``indirect=True`` with R_BROKERS for R rows."""
    fixture = {"redis": "redis_url", "embedded": "embedded_url", "rabbitmq": "rabbitmq_url",
               "rabbitmq-quorum": "rabbitmq_url"}
    name = str(request.param)
    url = str(request.getfixturevalue(fixture[name]))
    if name == "rabbitmq-quorum":  # every queue of the row a quorum queue
        url = ";".join(f"{one}{'&' if '?' in one else '?'}queue_type=quorum"
                       for one in url.split(";"))
    return ChaosBroker(name, url)


@dataclass
class ChaosRun:
    """One row's world: its processes, ledger, producer and broker client."""

    broker: ChaosBroker
    seed: int
    workdir: Path
    prefix: str
    procs: Procs
    client: Client
    producer: Producer
    rng: random.Random
    started_m: float = field(default_factory=time.monotonic)
    ports: dict[str, int] = field(default_factory=dict)

    @property
    def ledger_dir(self) -> Path:
        return Path(self.procs.env[LEDGER_ENV])

    def q(self, kind: str) -> str:
        """The row's queue of ``kind`` (flow, a, b, delay, poison, hang, hog)."""
        return apps.name(kind, self.prefix)

    def ledger(self) -> Ledger:
        return Ledger(self.ledger_dir)

    # --- processes ------------------------------------------------------------------------

    def start_master(self, slots: str | None = None, *extra: str, name: str = "master",
                     manager_port: int | None = None, wait: bool = True) -> int:
        """``qcluster master`` on a free port, host name ``name``; returns the port. Waits
        until its slots are past "starting" (none expected without ``slots``/manager)."""
        port = free_port()
        args = ["master", "--app", APP, "--broker", self.broker.url,
                "--listen", f"127.0.0.1:{port}", "--host-name", name]
        if slots:
            args += ["--slots", slots]
        if manager_port is not None:
            args += ["--manager", f"http://127.0.0.1:{manager_port}"]
        self.procs.start(name, *args, *extra)
        self.ports[name] = port
        if wait and (slots or manager_port is not None):
            wait_until(lambda: self._slots_up(port), message=f"{name}'s slots up")
        return port

    def start_manager(self, *extra: str, name: str = "manager") -> int:
        port = free_port()
        self.procs.start(name, "manager", "--broker", self.broker.url,
                         "--listen", f"127.0.0.1:{port}", *extra)
        self.ports[name] = port
        wait_until(lambda: self._answers(port, "/healthz"), message=f"{name} answering")
        return port

    def start_slot(self, queue: str, *extra: str, name: str = "slot") -> subprocess.Popen[bytes]:
        """One ``qcluster slot`` process (no master), logging to ``name``.log."""
        return self.procs.start(name, "slot", "--app", APP, "--queue", queue,
                                "--broker", self.broker.url, "--log-level", "WARNING", *extra)

    def slots(self, port: int) -> list[dict[str, Any]]:
        return list(get_json(port, "/api/v1/slots"))

    def slot_pids(self, port: int, queue: str | None = None,
                  state: str | None = None) -> list[int]:
        return [int(s["pid"]) for s in self.slots(port)
                if s.get("pid") and (queue is None or s["queue"] == queue)
                and (state is None or s["state"] == state)]

    def _slots_up(self, port: int) -> bool:
        try:
            slots = self.slots(port)
        except OSError:
            return False
        return bool(slots) and all(s["state"] != "starting" for s in slots)

    @staticmethod
    def _answers(port: int, path: str) -> bool:
        try:
            get_json(port, path)
        except (OSError, ValueError):
            return False
        return True

    def stop_all(self) -> None:
        self.procs.stop_all()

    @contextmanager
    def background_producer(self, queue: str, rate_jobs_s: float, *, tag: str = "bg",
                            fields: dict[str, Any] | None = None,
                            raise_errors: bool = False) -> Iterator[Producer]:
        """Enqueue about ``rate_jobs_s`` jobs per second (chunks every 0.1 s) from a thread
        with its own Client while the block runs; ids ``s{seed}-{tag}{n}``. Enqueue errors
        are recorded and kept going through unless ``raise_errors`` (then the thread stops
        and the error is raised at the end of the block)."""
        client = Client(self.broker.url)
        producer = Producer(client, self.ledger_dir, seed=self.seed, tag=tag)
        stop = threading.Event()
        failure: list[BaseException] = []

        def produce() -> None:
            began, sent = time.monotonic(), 0
            while not stop.is_set():
                due = int((time.monotonic() - began) * rate_jobs_s) - sent
                if due > 0:
                    try:
                        producer.enqueue(queue, due, fields=fields, raise_errors=raise_errors)
                    except Exception as exc:
                        failure.append(exc)
                        return
                    sent += due
                stop.wait(0.1)

        thread = threading.Thread(target=produce, name=f"producer-{tag}", daemon=True)
        thread.start()
        try:
            yield producer
        finally:
            stop.set()
            thread.join(timeout=120)
            client.close()
        if failure:
            raise failure[0]

    @staticmethod
    def kill(pid: int, sig: int = signal.SIGKILL) -> bool:
        """Send ``sig``; False if the process was already gone."""
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return False
        return True

    # --- draining and the verdict -------------------------------------------------------

    def dead_ids(self, queues: Iterable[str]) -> set[str]:
        return set(dead_letters(self.client.broker, queues))

    def settled(self, queues: list[str], *, with_dead: bool = True) -> bool:
        """Every acknowledged job finished or is dead-lettered, nothing ready or delayed
        (on Redis, nothing locked either: RabbitMQ's count is only this process's)."""
        ledger = self.ledger()
        acked = set(ledger.acks)
        done = ledger.completed_ids()
        if not acked <= done:
            missing = acked - done
            if not with_dead or not missing <= self.dead_ids(queues):
                return False
        for queue in queues:
            stats = self.client.broker.stats(queue)
            if stats.ready or stats.delayed:
                return False
            if self.broker.name != "rabbitmq" and stats.locked:
                return False
        return True

    def wait_drained(self, queues: list[str], timeout_s: float = 180.0,
                     message: str = "every acknowledged job finished or dead") -> None:
        wait_until(lambda: self.settled(queues), timeout_s=timeout_s, interval_s=0.5,
                   message=message)

    def report(self, queues: Iterable[str]) -> LedgerReport:
        return self.ledger().report(dead_ids=self.dead_ids(list(queues)))

    def finish(self, row: str, queues: list[str], *, faults: int,
               allowed_dead: Iterable[str] | None = None, stop: bool = True,
               **extra: Any) -> RowResult:
        """Stop the processes (unless ``stop`` is false), add up the ledger, measure the
        residue (dead letters allowed: ``allowed_dead``, default none), emit the row's
        line and return it. The queues are deleted by the fixture afterwards."""
        if stop:
            self.stop_all()
        wall_s = time.monotonic() - self.started_m
        dead = self.dead_ids(queues)
        report = self.ledger().report(dead_ids=dead)
        left = residue(self.client.broker, queues, allowed_dead=allowed_dead or ())
        extra.setdefault("dup_finished", report.dup_finished)
        extra.setdefault("recovered", report.recovered)
        if report.early:
            extra.setdefault("early", report.early)
        if report.torn_lines:
            extra.setdefault("torn_lines", report.torn_lines)
        if report.errors:
            extra.setdefault("enqueue_errors", report.errors)
        result = RowResult.from_report(row, self.broker.name, self.seed, report, faults=faults,
                                       residue=left, wall_s=wall_s, **extra)
        emit(result)
        if report.lost_ids or report.unexpected_ids:
            print(report.summary())
        return result


def delete_queues(client: Client, queues: Iterable[str]) -> None:
    delete = getattr(client.broker, "delete_queue", None)
    if delete is None:
        return
    for queue in queues:
        with suppress(Exception):
            delete(queue)


@pytest.fixture
def chaos(chaos_broker: ChaosBroker, chaos_seed: int, tmp_path: Path) -> Iterator[ChaosRun]:
    """A row's :class:`ChaosRun`; everything it started is stopped, its queues deleted."""
    prefix = f"c{uuid.uuid4().hex[:8]}"
    ledger_dir = tmp_path / "ledger"
    ledger_dir.mkdir()
    env = {LEDGER_ENV: str(ledger_dir), "QC_CHAOS_PREFIX": prefix,
           "QCLUSTER_METRICS_DIR": str(tmp_path / "metrics")}
    procs = Procs(tmp_path, env)
    client = Client(chaos_broker.url)
    run = ChaosRun(broker=chaos_broker, seed=chaos_seed, workdir=tmp_path, prefix=prefix,
                   procs=procs, client=client,
                   producer=Producer(client, ledger_dir, seed=chaos_seed),
                   rng=random.Random(chaos_seed))
    try:
        yield run
    finally:
        procs.stop_all()
        delete_queues(client, [apps.name(kind, prefix) for kind in
                               ("flow", "a", "b", "delay", "poison", "hang", "hog",
                                "take", "take1", "takeb1")])
        client.close()
