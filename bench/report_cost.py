"""The manager's own CPU per master report, in-process and independent of the machine's load.

    python -m bench.report_cost [--hosts 40] [--queues 150] [--slots 4] [--rounds 50]

Builds the manager's app as ``qcluster manager`` does (``create_app``, the cluster identity,
the learned periodic jobs) on a broker that is never called, and drives the ASGI app
directly (no HTTP client, no server: only the manager's own code runs) with the reports of
``--hosts`` masters of a ``--queues``-queue app: each body is what a master sends
(``master/reporter.py``: ``HostReport.model_dump_json``), with the policies of the fleet
bench's app (``bench/fleet_app.py``), ``--slots`` busy slots and their counters. Every
report is timed in the event loop thread's CPU time (``time.thread_time``), split as
``bench/fleet_manager.py`` splits the wall time:

- before: from the request's arrival at the app to the service's call (the middlewares,
  the routing, the body read, parsed and validated, the dependencies);
- work: ``ManagerService.try_receive`` (the report stored, the reply built);
- after: from the service's return to the reply's last byte (validated, serialised, sent).

Self-contained (only ``qcluster`` imports), so the same file measures another checkout's
code when run with that checkout's interpreter (an A/B against the code before):
``/other/checkout/.venv/bin/python bench/report_cost.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from qcluster.cluster_identity import ClusterClaim
from qcluster.config import load_settings
from qcluster.manager import service as service_module
from qcluster.manager.api.app import create_app
from qcluster.manager.planning.learned_periodic import LearnedPeriodic
from qcluster.manager.service import ManagerService
from qcluster.manager.state import ClusterState
from qcluster.messages import (
    BatchCounters,
    CodeInfo,
    HostFacts,
    HostReport,
    QueueCounters,
    SlotInfo,
)
from qcluster.policy import QueuePolicy

PHASES = ("before", "work", "after")
#: As bench/fleet_app.py: batch sizes and priorities in rotation, at most 16 slots each.
BATCH_SIZES = (1, 10, 10, 20, 50, 100, 1, 10)
PRIORITIES = (10, 5, 5, 1, 1, 0, 0, 0, 0, 1)
CLUSTER = ClusterClaim(id="0123456789abcdef", broker="redis://127.0.0.1:6379/0")


class UnusedBroker:
    """The report route never calls the broker; anything that does fails loudly."""

    safe_url = "redis://127.0.0.1:6379/0"

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the report path called the broker ({name})")


def policies(queues: int) -> dict[str, QueuePolicy]:
    return {f"fleet-{n:03d}": QueuePolicy.model_validate({
        "batch_size": BATCH_SIZES[n % len(BATCH_SIZES)],
        "priority": PRIORITIES[n % len(PRIORITIES)], "max_slots": 16})
        for n in range(queues)}


def report_body(host: int, served: dict[str, QueuePolicy], slots: int,
                now: float) -> bytes:
    """What master ``h{host:02d}`` posts: every queue's policy, ``slots`` busy slots and
    the counters of the queues they serve (as ``master/reporter.build_report``)."""
    names = list(served)
    chosen = [names[(host * 13 + i * 7) % len(names)] for i in range(slots)]
    infos = [SlotInfo(slot_no=i, pid=10_000 + host * 100 + i, queue=q, state="busy",
                      started_at=now - 600 - i, jobs_done=i * 10, pss_bytes=18 << 20,
                      private_dirty_bytes=6 << 20)
             for i, q in enumerate(chosen)]
    running = {q: chosen.count(q) for q in chosen}
    counters = {q: QueueCounters(counters=BatchCounters(done=50 * n, batches=n,
                                                        busy_s=1.2 * n),
                                 alive_s=2.0 * n) for q, n in running.items()}
    facts = HostFacts(cpus=2, loadavg=(4.0, 4.0, 4.0), mem_total_bytes=24 << 30,
                      mem_available_bytes=(20 + host % 3) << 30,
                      pss_total_bytes=(slots + 1) * (18 << 20), avg_slot_pss_bytes=18 << 20)
    report = HostReport(host=f"h{host:02d}", sent_at=now, interval_s=2.0, facts=facts,
                        capacity_slots=slots, queues=served, slots=infos, counters=counters,
                        generation=1, code=CodeInfo(version="0f3c9a1e"), cluster=CLUSTER)
    return report.model_dump_json(exclude={"searched", "held"}).encode()


def manager_app() -> tuple[Any, ManagerService]:
    """The app as ``qcluster manager`` makes it (manager/cli.py), its loop not started."""
    settings = load_settings(None)
    service = ManagerService(ClusterState(settings), UnusedBroker(), "s3cret")  # type: ignore[arg-type]
    service.learned = LearnedPeriodic(service, settings, None)
    app = create_app(service, loopback=True)
    app.state.cluster = CLUSTER
    app.state.local_token_only = False
    return app, service


class PhaseClock:
    """The event loop thread's CPU time at each phase's edge of the report being sent."""

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}

    def timed_receive(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def receive(service: ManagerService, report: HostReport) -> Any:
            self.marks["entered"] = time.thread_time()
            try:
                return original(service, report)
            finally:
                self.marks["left"] = time.thread_time()
        return receive


async def post(app: Any, body: bytes, clock: PhaseClock) -> tuple[int, bytes, list[float]]:
    """One report through the ASGI app; its status, reply and CPU seconds by phase."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/api/v1/reports",
             "raw_path": b"/api/v1/reports", "root_path": "", "query_string": b"",
             "headers": [(b"host", b"127.0.0.1:8500"), (b"content-type", b"application/json"),
                         (b"authorization", b"Bearer s3cret"),
                         (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8500)}
    sent = False
    status, chunks = 0, []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            await asyncio.sleep(3600)  # a client that stays connected
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                clock.marks["done"] = time.thread_time()

    clock.marks.clear()
    started = time.thread_time()
    await app(scope, receive, send)
    marks = clock.marks
    return status, b"".join(chunks), [marks["entered"] - started, marks["left"] - marks["entered"],
                                      marks["done"] - marks["left"]]


async def measure(hosts: int, queues: int, slots: int, rounds: int) -> dict[str, Any]:
    clock = PhaseClock()
    receive = service_module.ManagerService.try_receive
    service_module.ManagerService.try_receive = clock.timed_receive(receive)  # type: ignore[method-assign]
    try:
        app, service = manager_app()
        served = policies(queues)
        now = time.time()
        bodies = [report_body(h, served, slots, now) for h in range(hosts)]
        for body in bodies:  # the hosts known; then the state as after a planning round
            status, reply, _ = await post(app, body, clock)
            assert status == 200, reply
        state = service.state
        state.slot_map = {name: dict(json.loads(reply)["row"]) for name in state.hosts}
        state.planned_once, state.generation = True, 1
        samples: list[list[float]] = []
        gc.collect()
        for _ in range(rounds):
            for body in bodies:
                status, reply, spent = await post(app, body, clock)
                assert status == 200, reply
                samples.append(spent)
            for track in state.tracks.values():
                track.samples.clear()  # a round prunes them; keep the state's size steady
    finally:
        service_module.ManagerService.try_receive = receive  # type: ignore[method-assign]
    return summary(samples, len(bodies[0]))


def summary(samples: list[list[float]], body_bytes: int) -> dict[str, Any]:
    by_phase = {phase: [s[i] * 1e3 for s in samples] for i, phase in enumerate(PHASES)}
    totals = [sum(s) * 1e3 for s in samples]
    row: dict[str, Any] = {"reports": len(samples), "body_bytes": body_bytes}
    for phase, values in (*by_phase.items(), ("total", totals)):
        row[f"{phase}_mean_ms"] = round(statistics.fmean(values), 4)
        row[f"{phase}_p50_ms"] = round(statistics.median(values), 4)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=40)
    parser.add_argument("--queues", type=int, default=150)
    parser.add_argument("--slots", type=int, default=4, help="busy slots per host")
    parser.add_argument("--rounds", type=int, default=50, help="reports per host")
    args = parser.parse_args()
    row = asyncio.run(measure(args.hosts, args.queues, args.slots, args.rounds))
    print(json.dumps(row))
    print("CPU per report (ms, mean / p50): " + ", ".join(
        f"{phase} {row[f'{phase}_mean_ms']:.3f} / {row[f'{phase}_p50_ms']:.3f}"
        for phase in (*PHASES, "total")))


if __name__ == "__main__":
    main()
