"""The manager's HTTP API (FastAPI): routes that call the service (``manager/service.py``),
whose planning loop the app's lifespan starts and stops.

One router per area: ``reports`` (masters), ``cluster`` (the view, a queue's
history), ``controls`` (pause, drain, requeue), ``reload`` (rolling reload) and
``health`` (/healthz, /metrics); ``deps`` holds what they share (the service, the
token checks). Read-only by default; every mutating endpoint needs the token
(``Authorization: Bearer``), and so do masters' reports once a token is set (without one,
the manager only listens on loopback and takes reports from it). Bound to loopback, it also
refuses requests whose Host header is not a loopback name (DNS rebinding). Request bodies
above 1 MiB get 413; a report with a NaN, a negative or an out-of-range figure gets 422.
"""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from qcluster.manager.api import cluster, controls, health, jobs, login, reload, reports
from qcluster.manager.api.deps import NamePath
from qcluster.manager.api.login import Logins, SessionMiddleware
from qcluster.manager.service import ManagerService
from qcluster.security import MAX_BODY_BYTES, GuardMiddleware

__all__ = ["NamePath", "create_app"]

#: In the order the routes were always matched and listed in the OpenAPI document.
ROUTERS = (reports.router, cluster.router, controls.router, reload.router,
           health.router, login.router, jobs.router)


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
    app.state.service = service  # what the routes' dependencies read (deps.get_service)
    app.state.loopback = loopback
    app.state.logins = Logins()  # the admin page's one-time logins (manager/api/login.py)
    app.add_middleware(SessionMiddleware, logins=app.state.logins)
    app.add_middleware(GuardMiddleware, loopback=loopback, max_body_bytes=max_body_bytes)
    app.exception_handler(RecursionError)(too_deep)
    app.exception_handler(RequestValidationError)(invalid)
    for router in ROUTERS:
        app.include_router(router)
    if importlib.util.find_spec("qcluster.admin_ui.router") is not None:
        from qcluster.admin_ui.router import install

        install(app, service)
    return app


def too_deep(request: Request, exc: RecursionError) -> JSONResponse:
    return JSONResponse({"detail": "request body nested too deeply"}, status_code=400)


def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 naming each bad field, without echoing its value (a NaN is no JSON)."""
    errors = [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")),
               "type": str(e.get("type", ""))} for e in exc.errors()[:50]]
    return JSONResponse({"detail": errors}, status_code=422)
