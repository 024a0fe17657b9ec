"""``qcluster manager`` with the timings the fleet bench reads from outside.

    python -m bench.fleet_manager [qcluster manager options]

- each report's time from its arrival at the application (request parsed) to its reply's
  last byte, measured around the ASGI application, and where it went: before the service
  is called (the body read and validated, the dependency, the thread pool's queue), the
  state lock's wait, the work under it, and after (the reply serialised and sent); the
  event loop thread's wait for a CPU over the report (``/proc``'s schedstat run delay:
  the machine's load, not the manager's doing);
- each planning round's CPU seconds (its thread's), wall seconds and the seconds it held
  the state lock;
- the manager's threads' CPU and their wait for a CPU, summed (``/proc/self/task``).

``GET /bench/timings`` answers the samples gathered since the previous call. Nothing else
of the manager changes: the bench measures the product as users run it, plus this."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from qcluster.manager import service
from qcluster.manager.api import app as api
from qcluster.manager.planning import round_loop

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

REPORTS = "/api/v1/reports"
TIMINGS = "/bench/timings"
PLANNER = "manager-planner"
#: The report phases (seconds each): /bench/timings answers one list per phase.
PHASES = ("report_before_s", "report_lock_wait_s", "report_work_s", "report_after_s",
          "report_loop_cpu_wait_s")

_lock = threading.Lock()
_samples: dict[str, list[float]] = {
    kind: [] for kind in ("report_s", *PHASES, "round_cpu_s", "round_wall_s",
                          "round_lock_held_s", "reader_lock_held_s")}
_report: ContextVar[dict[str, float] | None] = ContextVar("report", default=None)
_held = threading.local()


def _record(kind: str, value: float) -> None:
    with _lock:
        _samples[kind].append(value)


def _take_samples() -> dict[str, Any]:
    with _lock:
        taken: dict[str, Any] = {kind: list(values) for kind, values in _samples.items()}
        for values in _samples.values():
            values.clear()
    taken["threads"] = threads_schedstat()
    return taken


def run_delay_s(path: str = "/proc/thread-self/schedstat") -> float:
    """Seconds this thread has waited on a run queue (runnable, no CPU) since it started."""
    try:
        return int(Path(path).read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def threads_schedstat() -> dict[str, float]:
    """The manager's live threads, summed: CPU seconds and seconds waited for a CPU."""
    cpu = waited = 0.0
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "schedstat").read_text().split()
        except OSError:
            continue  # the thread ended
        cpu += int(fields[0]) / 1e9
        waited += int(fields[1]) / 1e9
    return {"cpu_s": cpu, "cpu_wait_s": waited}


class TimedLock:
    """The state lock (a re-entrant one) with each outermost hold's wait and length: the
    round's holds, the readers' (views, controls) and each report's wait."""

    def __init__(self, lock: Any) -> None:
        self._lock = lock

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        asked = time.perf_counter()
        got = bool(self._lock.acquire(blocking, timeout))
        if got:
            depth = getattr(_held, "depth", 0)
            if depth == 0:
                _held.since = time.perf_counter()
                _held.waited = _held.since - asked
            _held.depth = depth + 1
        return got

    def release(self) -> None:
        _held.depth -= 1
        if _held.depth == 0:
            held = time.perf_counter() - _held.since
            name = threading.current_thread().name
            if name == PLANNER:
                _held.round_held = getattr(_held, "round_held", 0.0) + held
            elif _report.get() is None:
                _record("reader_lock_held_s", held)
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class Timed:
    """The manager's ASGI application, with the report route timed and the timings route."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def __getattr__(self, name: str) -> Any:
        return getattr(self.app, name)  # the manager sets app.state after create_app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
        elif scope["path"] == TIMINGS:
            await _send_json(send, _take_samples())
        elif scope["path"] == REPORTS:
            await self._timed(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _timed(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        loop_waited = run_delay_s()
        phases: dict[str, float] = {}
        _report.set(phases)  # the thread running the endpoint gets a copy of this context

        async def send_timed(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                done = time.perf_counter()
                _record("report_s", done - started)
                _record("report_loop_cpu_wait_s", run_delay_s() - loop_waited)
                if "entered" in phases:
                    _record("report_before_s", phases["entered"] - started)
                    _record("report_lock_wait_s", phases["waited"])
                    _record("report_work_s", phases["left"] - phases["entered"]
                            - phases["waited"])
                    _record("report_after_s", done - phases["left"])

        await self.app(scope, receive, send_timed)


async def _send_json(send: Send, value: object) -> None:
    body = json.dumps(value).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _timed_round(original: Callable[[round_loop.RoundLoop], None]) -> Callable[..., None]:
    def timed(self: round_loop.RoundLoop) -> None:
        cpu, wall = time.thread_time(), time.perf_counter()
        _held.round_held = 0.0
        original(self)
        _record("round_cpu_s", time.thread_time() - cpu)
        _record("round_wall_s", time.perf_counter() - wall)
        _record("round_lock_held_s", _held.round_held)
    return timed


def _timed_receive(original: Callable[..., Any]) -> Callable[..., Any]:
    def receive(self: service.ManagerService, report: Any) -> Any:
        entered = time.perf_counter()
        _held.waited = 0.0
        try:
            return original(self, report)
        finally:
            phases = _report.get()
            if phases is not None:
                # A try that found the lock held, then the pool thread's wait: both wait.
                first = phases.get("entered", entered)
                phases.update(entered=first, waited=entered - first + _held.waited,
                              left=time.perf_counter())
    return receive


def _timed_init(original: Callable[..., None]) -> Callable[..., None]:
    def init(self: round_loop.RoundLoop, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        timed = TimedLock(self.lock)
        # Every holder of the state lock: the loop, the service and the collaborators.
        self.lock = timed  # type: ignore[assignment]
        for part in (self.watch, self.desk, self.reloads):
            part.lock = timed  # type: ignore[assignment]
    return init


def main() -> None:
    original_create = api.create_app
    api.create_app = lambda *args, **kwargs: Timed(  # type: ignore[assignment]
        original_create(*args, **kwargs))
    round_loop.RoundLoop.round = _timed_round(round_loop.RoundLoop.round)  # type: ignore[method-assign]
    round_loop.RoundLoop.__init__ = _timed_init(round_loop.RoundLoop.__init__)  # type: ignore[method-assign]
    service.ManagerService.receive = _timed_receive(  # type: ignore[method-assign]
        service.ManagerService.receive)
    if hasattr(service.ManagerService, "try_receive"):  # on the event loop, lock free
        service.ManagerService.try_receive = _timed_receive(  # type: ignore[method-assign]
            service.ManagerService.try_receive)
    from qcluster.cli import main as qcluster_main

    sys.argv = ["qcluster", "manager", *sys.argv[1:]]
    qcluster_main()


if __name__ == "__main__":
    main()
