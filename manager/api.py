"""The manager's HTTP API (FastAPI): routes that call the service (``manager/service.py``),
whose planning loop the app's lifespan starts and stops.

Read-only by default; every mutating endpoint needs the token (``Authorization: Bearer``),
and so do masters' reports once a token is set (without one, the manager only listens on
loopback and takes reports from it). Bound to loopback, it also refuses requests whose Host
header is not a loopback name (DNS rebinding). Request bodies above 1 MiB get 413; a report
with a NaN, a negative or an out-of-range figure gets 422.
"""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, HTTPException, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from qcluster.errors import BrokerError
from qcluster.manager.service import ManagerService, ReloadRefused
from qcluster.messages import Assignment, HistoryPoint, HostReport
from qcluster.policy import QUEUE_NAME_PATTERN
from qcluster.security import MAX_BODY_BYTES, GuardMiddleware, bearer_token

#: A queue or host in a path: the queue-name rule (422 otherwise, before any broker call).
NamePath = Annotated[str, Path(pattern=QUEUE_NAME_PATTERN)]


def create_app(service: ManagerService, *, loopback: bool = True,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.start()  # the planning loop runs while the server serves
        try:
            yield
        finally:
            service.stop()

    app = FastAPI(
        lifespan=lifespan,
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
        if service.tokens or not loopback:
            authorised(authorization)

    guarded = [Depends(authorised)]

    @app.post("/api/v1/reports", tags=["masters"], dependencies=[Depends(reporter_authorised)])
    def report(body: HostReport) -> Assignment:
        """A master's report; the reply is its row of the slot map."""
        return service.receive(body)

    @app.get("/api/v1/cluster", tags=["cluster"])
    def cluster() -> JSONResponse:
        """Queues, hosts, slot map and decisions (newest first); ``broker``: the broker's
        nodes (address, role, ok or the error, a Cluster master's hash slots) and the node
        serving each queue, as the last broker check read them (null before the first);
        ``reload``: the rolling reload running or the last one (null: none yet)."""
        body = service.cluster_view().model_dump(by_alias=True, mode="json")
        nodes = service.broker_nodes()
        body["broker"] = nodes.model_dump(mode="json") if nodes is not None else None
        body["reload"] = service.reload_status()
        return JSONResponse(body)

    @app.get("/api/v1/queues/{queue}/history", tags=["cluster"])
    def history(queue: NamePath) -> list[HistoryPoint]:
        return service.queue_history(queue)

    def actor(authorization: Annotated[str | None, Header()] = None) -> str:
        """The name of the request's token (who changes a control); 401 without one."""
        name = service.token_name(bearer_token(authorization))
        if name is None:
            raise HTTPException(401, "a valid token is required (Authorization: Bearer ...)",
                                headers={"WWW-Authenticate": "Bearer"})
        return name

    def stored(change: Callable[[], Any]) -> Any:
        """A control change, or 503 when the broker cannot keep it (nothing changed)."""
        try:
            return change()
        except BrokerError as exc:
            raise HTTPException(503, f"the broker did not store the change: {exc}") from None

    @app.get("/api/v1/controls", tags=["control"])
    def controls() -> list[dict[str, Any]]:
        """Pauses and drains in force, each with who (the token's name) and when."""
        return [c.model_dump() for c in service.controls()]

    @app.post("/api/v1/queues/{queue}/pause", tags=["control"])
    def pause(queue: NamePath, by: str = Depends(actor)) -> dict[str, Any]:
        """Plan no slot for the queue until it is resumed (kept in the broker: a restarted
        manager keeps it)."""
        control = stored(lambda: service.pause(queue, by))
        return {"queue": queue, "paused": True, "by": control.by, "at": control.at}

    @app.post("/api/v1/queues/{queue}/resume", tags=["control"], dependencies=guarded)
    def resume(queue: NamePath) -> dict[str, Any]:
        stored(lambda: service.resume(queue))
        return {"queue": queue, "paused": False}

    @app.post("/api/v1/queues/{queue}/requeue-dead", tags=["control"], dependencies=guarded)
    def requeue_dead(queue: NamePath) -> dict[str, Any]:
        return {"queue": queue, "requeued": service.requeue_dead(queue)}

    @app.post("/api/v1/hosts/{host}/drain", tags=["control"])
    def drain(host: NamePath, by: str = Depends(actor)) -> dict[str, Any]:
        """Plan no slot on the host (its slots move to the others) until it is undrained
        (kept in the broker: a restarted manager keeps it)."""
        control = stored(lambda: service.drain(host, by))
        return {"host": host, "drained": True, "by": control.by, "at": control.at}

    @app.post("/api/v1/hosts/{host}/undrain", tags=["control"], dependencies=guarded)
    def undrain(host: NamePath) -> dict[str, Any]:
        stored(lambda: service.undrain(host))
        return {"host": host, "drained": False}

    def reloading(host: str | None, by: str) -> dict[str, Any]:
        try:
            return service.reload(host, by)
        except ReloadRefused as exc:
            raise HTTPException(exc.status, str(exc)) from None

    @app.post("/api/v1/hosts/{host}/reload", tags=["reload"])
    def reload_host(host: NamePath, by: str = Depends(actor)) -> dict[str, Any]:
        """Ask the host's master to reload its code (a fresh template, slots replaced a few
        at a time): its next reply carries a new ``reload_id``. Answers the rollout; 404 an
        unknown host, 409 the host not reporting or a reload already running."""
        return reloading(host, by)

    @app.post("/api/v1/reload", tags=["reload"])
    def reload_all(by: str = Depends(actor)) -> dict[str, Any]:
        """Reload every reporting host, one at a time by name: the next host is asked once
        the previous one took the new code (or was skipped: it stopped reporting, or did
        not take the request up within 30 s); a host that fails stops the rollout. 409 when
        a reload is running or no host reports."""
        return reloading(None, by)

    @app.get("/api/v1/reload", tags=["reload"])
    def reload_status() -> JSONResponse:
        """The rolling reload running, or the last one (null: none since the manager
        started): each host's step (waiting, asked, took, failed, skipped) and note."""
        return JSONResponse(service.reload_status())

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, str]:
        """Liveness, always 200: ``{"status": "ok"}``, or ``{"status": "degraded", "broker":
        REASON}`` while the planning loop's last broker read failed."""
        return service.health()

    @app.get("/metrics", tags=["health"])
    def metrics() -> Response:
        from qcluster.manager.metrics import render

        body, content_type = render(service)
        return Response(body, media_type=content_type)

    if importlib.util.find_spec("qcluster.admin_ui.router") is not None:
        from qcluster.admin_ui.router import install

        install(app, service)
    return app
