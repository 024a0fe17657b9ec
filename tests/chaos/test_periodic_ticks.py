"""Row P1 (``chaos`` marker, ``make chaos``): periodic ticks through faults.

A real ``qcluster manager`` enqueues two every-1 s periodic jobs through a TCP proxy
(tests/tcp_proxy.py) to a private Redis or RabbitMQ, for 10 minutes (``QC_CHAOS_P1_MIN``),
while a seeded schedule injects, every 10-30 s, one of: late replies (every chunk both
ways delayed 3 s for 8 s: a Redis call's reply comes after its 5 s socket timeout, when
its command has run), a reset of every link (both ends get an RST), or a SIGKILL of the
manager (restarted 1-4 s later). A consumer beside it takes and acks every tick's job
as it comes, recording each in the ledger (tests/chaos/ledger.py), so that a tick
enqueued again after its first copy was taken would be counted twice.

Threshold: every tick from the first to the last is enqueued exactly once (lost 0,
dup_exec 0), none taken before its time (early 0), residue 0. Ticks missed while the
manager was down are enqueued by the restarted one (``catch_up`` 1000, ``missed_after``
900 s).
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from qcluster.broker import open_broker
from qcluster.broker.base import Broker
from qcluster.job import decode_envelope
from tests.chaos.ledger import append_lines
from tests.chaos.rows import RowResult, by_profile, emit
from tests.conftest import free_port, wait_until
from tests.e2e.cluster import Procs, try_json
from tests.tcp_proxy import TcpProxy

pytestmark = pytest.mark.chaos

TOKEN = "chaos-periodic-4b8e1d7c2a9f3e6b"
JOBS = ("a", "b")
#: Minutes of faults (the issue's 10 by default).
MINUTES = float(os.environ.get("QC_CHAOS_P1_MIN", "10"))
LATE_S = 3.0
LATE_FOR_S = 8.0


def config(path: Path, prefix: str) -> Path:
    path.write_text("".join(f"""
[periodic.{prefix}-{job}]
queue = "{prefix}-{job}"
every = 1
missed_after = 900
catch_up = 1000
""" for job in JOBS))
    return path


def proxied(url: str, proxy: TcpProxy) -> str:
    parts = urlsplit(url)
    userinfo = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
    return urlunsplit(parts._replace(netloc=f"{userinfo}127.0.0.1:{proxy.port}"))


class Consumer:
    """Takes and acks the ticks' jobs directly (not through the proxy), recording a
    ``start`` and a ``finish`` line per job, its id the tick's job id."""

    def __init__(self, url: str, queues: list[str], ledger: Path) -> None:
        self.url, self.queues, self.ledger = url, queues, ledger
        self.stopped = threading.Event()
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        broker = open_broker(self.url)
        try:
            while not self.stopped.is_set():
                for queue in self.queues:
                    self.take(broker, queue)
        finally:
            broker.close()

    def take(self, broker: Broker, queue: str) -> int:
        try:
            batch = broker.take(queue, max_jobs=100, lock_timeout_s=60, wait_s=0.2)
        except Exception as exc:  # recorded: the row fails on it
            self.errors.append(repr(exc))
            time.sleep(0.5)
            return 0
        mono, wall = time.monotonic(), time.time()
        lines = []
        for delivery in batch:
            tick = int(decode_envelope(delivery.body).headers["qcluster-tick"])
            for event in ("start", "finish"):
                lines.append({"e": event, "id": delivery.id, "q": queue, "a": 1, "m": mono,
                              "t": wall, "tick": tick, "pid": os.getpid()})
        append_lines(self.ledger, "h", lines)
        if batch:
            broker.ack(queue, batch)
        return len(batch)

    def drain(self) -> None:
        self.stopped.set()
        self.thread.join(60)
        broker = open_broker(self.url)
        try:
            for queue in self.queues:
                while self.take(broker, queue):
                    pass
        finally:
            broker.close()


def read_runs(ledger: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for path in ledger.glob("h-*.jsonl")
            for line in path.read_text().splitlines() if '"e":"start"' in line]


class Faults:
    """The seeded schedule: late replies, resets, manager kills."""

    def __init__(self, seed: int, proxy: TcpProxy, procs: Procs, manager_args: list[str]):
        import random
        self.rng = random.Random(seed)
        self.proxy, self.procs, self.args = proxy, procs, manager_args
        self.count: Counter[str] = Counter()
        self.manager = self.start_manager()

    def start_manager(self) -> object:
        port = free_port()
        proc = self.procs.start(f"manager-{sum(self.count.values())}", "manager",
                                *self.args, "--listen", f"127.0.0.1:{port}")
        wait_until(lambda: try_json(port, "/healthz"), timeout_s=60, message="manager up")
        return proc

    def one(self) -> None:
        kind = self.rng.choice(["late", "reset", "kill"])
        self.count[kind] += 1
        if kind == "late":
            self.proxy.set_latency(LATE_S)
            time.sleep(LATE_FOR_S)
            self.proxy.restore()
        elif kind == "reset":
            self.proxy.reset()
        else:
            os.killpg(self.manager.pid, signal.SIGKILL)  # type: ignore[attr-defined]
            self.manager.wait()  # type: ignore[attr-defined]
            time.sleep(self.rng.uniform(1, 4))
            self.manager = self.start_manager()

    def run(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(left, self.rng.uniform(10, 30)))
            if end - time.monotonic() > 0:
                self.one()


@pytest.mark.timeout(MINUTES * 60 + 600)  # the faults, then managers' starts and the drain
@pytest.mark.parametrize("backend", ["redis", "rabbitmq"])
def test_p1_periodic_ticks_exactly_once_through_faults(
        backend: str, request: pytest.FixtureRequest, chaos_seed: int, tmp_path: Path) -> None:
    url = str(request.getfixturevalue(f"{backend}_url"))
    prefix = f"p1{uuid.uuid4().hex[:8]}"
    queues = [f"{prefix}-{job}" for job in JOBS]
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    procs = Procs(tmp_path, {"QCLUSTER_TOKEN": TOKEN})
    consumer = Consumer(url, queues, ledger)
    began = time.monotonic()
    parts = urlsplit(url)
    with TcpProxy((parts.hostname or "127.0.0.1", parts.port or 0)) as proxy:
        args = ["--config", str(config(tmp_path / "qcluster.toml", prefix)),
                "--broker", proxied(url, proxy)]
        started = time.time()
        faults = Faults(chaos_seed, proxy, procs, args)
        consumer.thread.start()
        try:
            faults.run(by_profile(60.0, MINUTES * 60))
            stopped = time.time()
            time.sleep(3)  # the last ticks' passes
        finally:
            procs.stop_all()
            consumer.drain()
    tally = Tally(read_runs(ledger), queues)
    logs = "\n".join(procs.log(f"manager-{n}") for n in range(sum(faults.count.values()) + 1))
    assert tally.spans(started, stopped), f"the ticks do not span the run\n{logs[-6000:]}"
    residue = residue_of(url, queues)
    emit(RowResult(
        row="P1", broker=backend, seed=chaos_seed, attempted=len(tally.expected),
        acknowledged=len(tally.expected), completed=len(tally.expected & set(tally.per_id)),
        lost=len(tally.lost), unexpected=len(tally.unexpected), dup_exec=tally.dup_exec,
        faults=sum(faults.count.values()), residue=residue,
        wall_s=round(time.monotonic() - began, 2),
        extra={"ticks": len(tally.expected), "early": len(tally.early),
               "late_replies": faults.count["late"], "resets": faults.count["reset"],
               "manager_kills": faults.count["kill"], "consumer_errors": len(consumer.errors),
               "ticker_errors": len(re.findall(r"periodic .*\(trying again\)", logs)),
               "minutes": round((stopped - started) / 60, 1)}))
    assert not tally.lost, f"ticks lost: {sorted(tally.lost)[:20]}\n{logs[-6000:]}"
    assert not tally.dup_exec, f"ticks enqueued twice: {tally.duplicated()[:20]}\n{logs[-6000:]}"
    assert not tally.unexpected, f"ticks outside the run: {sorted(tally.unexpected)[:20]}"
    assert not tally.early, f"ticks taken before their time: {tally.early[:5]}"
    assert not sum(residue.values()), residue


class Tally:
    """The ledger's ticks: every tick from each job's first to its last is expected."""

    def __init__(self, runs: list[dict[str, Any]], queues: list[str]) -> None:
        self.runs = runs
        self.per_id = Counter(str(run["id"]) for run in runs)
        self.ticks = {queue: sorted(int(run["tick"]) for run in runs if run["q"] == queue)
                      for queue in queues}
        self.expected = {f"periodic.{queue}.{tick}" for queue, ticks in self.ticks.items()
                         if ticks for tick in range(ticks[0], ticks[-1] + 1, 1000)}
        self.lost = self.expected - set(self.per_id)
        self.unexpected = set(self.per_id) - self.expected
        self.dup_exec = sum(n - 1 for n in self.per_id.values())
        self.early = [run for run in runs if float(run["t"]) * 1000 < int(run["tick"])]

    def spans(self, started: float, stopped: float) -> bool:
        """Each job's ticks begin within a minute of the start and end near the stop."""
        return all(ticks and ticks[0] <= (started + 60) * 1000
                   and ticks[-1] >= (stopped - 10) * 1000 for ticks in self.ticks.values())

    def duplicated(self) -> list[str]:
        return sorted(job for job, n in self.per_id.items() if n > 1)


def residue_of(url: str, queues: list[str]) -> dict[str, int]:
    broker = open_broker(url)
    try:
        stats = [broker.stats(queue) for queue in queues]
    finally:
        broker.close()
    return {"ready": sum(s.ready for s in stats), "locked": sum(s.locked for s in stats),
            "delayed": sum(s.delayed for s in stats), "dead": sum(s.dead for s in stats)}
