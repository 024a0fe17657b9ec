"""The manager's HTTP API (FastAPI) and its planning loop.

Read-only by default; every mutating endpoint needs the token (``Authorization: Bearer``),
and so do masters' reports once a token is set (without one, the manager only listens on
loopback and takes reports from it). Bound to loopback, it also refuses requests whose Host
header is not a loopback name (DNS rebinding). Request bodies above 1 MiB get 413; a report
with a NaN, a negative or an out-of-range figure gets 422.
"""

from __future__ import annotations

import importlib.util
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, HTTPException, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from manager.recorder import Recorder
from manager.state import ClusterState
from qcluster.broker.base import Broker, DeadJob
from qcluster.errors import BrokerError, ConfigError
from qcluster.messages import (
    Assignment,
    ClusterView,
    HistoryPoint,
    HostReport,
    UndeclaredQueueView,
)
from qcluster.policy import QUEUE_NAME_PATTERN
from qcluster.security import MAX_BODY_BYTES, GuardMiddleware, bearer_token

logger = logging.getLogger(__name__)
#: A queue or host in a path: the queue-name rule (422 otherwise, before any broker call).
NamePath = Annotated[str, Path(pattern=QUEUE_NAME_PATTERN)]
#: How often the planning loop re-reads the broker's durability and its undeclared queues:
#: a round trip per broker queue, not worth paying every round or on every page load.
BROKER_CHECK_INTERVAL_S = 60.0


class ManagerService:
    """The state plus the broker: what the API, the admin UI and the loop work on.

    Implements admin_ui.source.ClusterSource.
    """

    def __init__(self, state: ClusterState, broker: Broker, token: str | None,
                 clock: Callable[[], float] = time.time) -> None:
        self.state = state
        self.broker = broker
        self.token = token
        self.clock = clock
        self.broker_lock = threading.Lock()
        self.stopped = threading.Event()
        self.recorder: Recorder | None = None
        """Set by ``--record``: writes what each round observed."""
        self.next_broker_check = 0.0
        self.warned_undeclared: set[str] = set()

    # ClusterSource
    def cluster_view(self) -> ClusterView:
        return self.state.view(self.clock())

    def queue_history(self, queue: str) -> list[HistoryPoint]:
        return self.state.history(queue)

    def dead_jobs(self, queue: str, limit: int = 50) -> list[DeadJob]:
        with self.broker_lock:
            return self.broker.dead_jobs(queue, limit=limit)

    def requeue_dead(self, queue: str) -> int:
        with self.broker_lock:
            return self.broker.requeue_dead(queue)

    def check_token(self, token: str | None) -> bool:
        return bool(self.token) and token is not None and secrets.compare_digest(
            token.encode(), (self.token or "").encode())

    # the planning loop
    def refresh_stats(self) -> None:
        queues = list(self.state.policies(self.clock()))
        stats = {}
        with self.broker_lock:
            for queue in queues:
                try:
                    stats[queue] = self.broker.stats(queue)
                except BrokerError as exc:
                    logger.warning("broker stats for %s failed: %s", queue, exc)
        self.state.set_stats(stats)

    def check_broker(self) -> None:
        """Store the broker's durability notes and the queues holding jobs that no live
        host's app declares (warned once each in the log) for the overview page."""
        self.next_broker_check = time.monotonic() + BROKER_CHECK_INTERVAL_S
        declared = set(self.state.policies(self.clock()))
        undeclared: list[UndeclaredQueueView] | None = None  # None: keep the last known
        with self.broker_lock:
            try:
                durability = self.broker.durability()
            except (BrokerError, ConfigError) as exc:
                durability = [str(exc)]
            try:
                undeclared = self._undeclared(declared)
            except BrokerError as exc:
                logger.warning("broker queue listing failed: %s", exc)
        self._warn_undeclared(undeclared)
        self.state.set_broker_warnings(undeclared=undeclared, durability=durability)

    def _undeclared(self, declared: set[str]) -> list[UndeclaredQueueView]:
        """Broker queues outside ``declared`` with ready or delayed jobs (caller holds the lock)."""
        found = []
        for queue in sorted(set(self.broker.queues()) - declared):
            stats = self.broker.stats(queue)
            if stats.ready or stats.delayed:
                found.append(UndeclaredQueueView(name=queue, ready=stats.ready,
                                                 delayed=stats.delayed))
        return found

    def _warn_undeclared(self, undeclared: list[UndeclaredQueueView] | None) -> None:
        for queue in undeclared or []:
            if queue.name not in self.warned_undeclared:
                logger.warning("queue %s holds %d jobs but no app declares it: they wait "
                               "until one does", queue.name, queue.ready + queue.delayed)
        if undeclared is not None:
            self.warned_undeclared = {q.name for q in undeclared}

    def round(self) -> None:
        started = time.perf_counter()
        self.refresh_stats()
        if time.monotonic() >= self.next_broker_check:
            self.check_broker()
        now = self.clock()
        for decision in self.state.plan_round(now):
            logger.info("decision: %s", decision.reason)
        if self.recorder is not None:
            self.recorder.record(self.state, now)
        self.last_round_s = time.perf_counter() - started

    def loop(self) -> None:
        interval = self.state.cfg.interval_s
        while not self.stopped.wait(interval):
            try:
                self.round()
            except Exception:  # the loop must outlive one bad round
                logger.exception("planning round failed")

    def start(self) -> None:
        try:
            self.check_broker()
        except Exception:  # a warning for the page must not stop the manager
            logger.exception("broker check failed")
        threading.Thread(target=self.loop, name="manager-planner", daemon=True).start()


def create_app(service: ManagerService, *, loopback: bool = True,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(
        title="qcluster manager",
        description="Plans slots per queue from backlog and throughput, places them on hosts "
                    "and explains every decision. Mutating endpoints need the token.",
        version="0.1.0",
    )
    app.add_middleware(GuardMiddleware, loopback=loopback, max_body_bytes=max_body_bytes)

    @app.exception_handler(RecursionError)
    def too_deep(request: Request, exc: RecursionError) -> JSONResponse:
        return JSONResponse({"detail": "request body nested too deeply"}, status_code=400)

    @app.exception_handler(RequestValidationError)
    def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        """422 naming each bad field, without echoing its value (a NaN is no JSON)."""
        errors = [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")),
                   "type": str(e.get("type", ""))} for e in exc.errors()[:50]]
        return JSONResponse({"detail": errors}, status_code=422)

    def authorised(authorization: Annotated[str | None, Header()] = None) -> None:
        if not service.check_token(bearer_token(authorization)):
            raise HTTPException(401, "a valid token is required (Authorization: Bearer ...)",
                                headers={"WWW-Authenticate": "Bearer"})

    def reporter_authorised(authorization: Annotated[str | None, Header()] = None) -> None:
        """With a token set, reports need it; without one, only a loopback manager (the
        CLI refuses a public bind without a token) takes them, from this machine."""
        if service.token or not loopback:
            authorised(authorization)

    guarded = [Depends(authorised)]

    @app.post("/api/v1/reports", tags=["masters"], dependencies=[Depends(reporter_authorised)])
    def report(body: HostReport) -> Assignment:
        """A master's report; the reply is its row of the slot map."""
        return service.state.receive(body, service.clock())

    @app.get("/api/v1/cluster", tags=["cluster"])
    def cluster() -> JSONResponse:
        """Queues, hosts, slot map and decisions (newest first)."""
        return JSONResponse(service.cluster_view().model_dump(by_alias=True, mode="json"))

    @app.get("/api/v1/queues/{queue}/history", tags=["cluster"])
    def history(queue: NamePath) -> list[HistoryPoint]:
        return service.queue_history(queue)

    @app.post("/api/v1/queues/{queue}/pause", tags=["control"], dependencies=guarded)
    def pause(queue: NamePath) -> dict[str, Any]:
        """Plan no slot for the queue until it is resumed."""
        with service.state.lock:
            service.state.paused.add(queue)
        return {"queue": queue, "paused": True}

    @app.post("/api/v1/queues/{queue}/resume", tags=["control"], dependencies=guarded)
    def resume(queue: NamePath) -> dict[str, Any]:
        with service.state.lock:
            service.state.paused.discard(queue)
        return {"queue": queue, "paused": False}

    @app.post("/api/v1/queues/{queue}/requeue-dead", tags=["control"], dependencies=guarded)
    def requeue_dead(queue: NamePath) -> dict[str, Any]:
        return {"queue": queue, "requeued": service.requeue_dead(queue)}

    @app.post("/api/v1/hosts/{host}/drain", tags=["control"], dependencies=guarded)
    def drain(host: NamePath) -> dict[str, Any]:
        """Plan no slot on the host (its slots move to the others) until the manager restarts."""
        with service.state.lock:
            service.state.drained.add(host)
        return {"host": host, "drained": True}

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", tags=["health"])
    def metrics() -> Response:
        from manager.metrics import render

        body, content_type = render(service)
        return Response(body, media_type=content_type)

    if importlib.util.find_spec("admin_ui.router") is not None:
        from admin_ui.router import install

        install(app, service)
    return app
