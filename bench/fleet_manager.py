"""``qcluster manager`` with two timings the fleet bench reads from outside.

    python -m bench.fleet_manager [qcluster manager options]

- each report's time from its arrival at the application (request parsed) to its reply's
  last byte, measured around the ASGI application;
- each planning round's CPU seconds (its thread's) and wall seconds.

``GET /bench/timings`` answers the samples gathered since the previous call. Nothing else
of the manager changes: the bench measures the product as users run it, plus this."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from qcluster.manager import api, round_loop

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

REPORTS = "/api/v1/reports"
TIMINGS = "/bench/timings"

_lock = threading.Lock()
_samples: dict[str, list[float]] = {"report_s": [], "round_cpu_s": [], "round_wall_s": []}


def _record(kind: str, value: float) -> None:
    with _lock:
        _samples[kind].append(value)


def _take_samples() -> dict[str, list[float]]:
    with _lock:
        taken = {kind: list(values) for kind, values in _samples.items()}
        for values in _samples.values():
            values.clear()
    return taken


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

        async def send_timed(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                _record("report_s", time.perf_counter() - started)

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
        original(self)
        _record("round_cpu_s", time.thread_time() - cpu)
        _record("round_wall_s", time.perf_counter() - wall)
    return timed


def main() -> None:
    original_create = api.create_app
    api.create_app = lambda *args, **kwargs: Timed(  # type: ignore[assignment]
        original_create(*args, **kwargs))
    round_loop.RoundLoop.round = _timed_round(round_loop.RoundLoop.round)  # type: ignore[method-assign]
    from qcluster.cli import main as qcluster_main

    sys.argv = ["qcluster", "manager", *sys.argv[1:]]
    qcluster_main()


if __name__ == "__main__":
    main()
