"""``POST /api/v1/reports``: a master's report, answered with its row of the slot map.
``POST /api/v1/hosts/{host}/leave``: a master that stops cleanly says so.
``GET /api/v1/identity``: the cluster identity of the manager's broker
(qcluster.cluster_identity)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any, NoReturn

from fastapi import APIRouter, Depends, HTTPException, Request, Response
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool

from qcluster.cluster_identity import mismatch
from qcluster.manager.api.deps import NamePath, ServiceDep, reporter_authorised
from qcluster.manager.api.report_body import ReportReader
from qcluster.messages import Assignment, HostReport

router = APIRouter(tags=["masters"])
logger = logging.getLogger(__name__)
REPORTS_PATH = "/api/v1/reports"


async def report(body: HostReport, service: ServiceDep, request: Request) -> Assignment:
    """A master's report; the reply is its row of the slot map (409: another broker).

    Answered on the event loop when the state lock is free (it is held to copy and to
    publish, never to compute: ``ManagerService.try_receive``); otherwise in a thread of
    the pool, which waits for it. A sync route waited for a pool thread three times per
    report (the dependency, the route, the reply's validation): under 40 masters' reports
    and a planning round holding the interpreter, each wait was milliseconds."""
    refusal = mismatch(getattr(request.app.state, "cluster", None), body.cluster,
                       who=f"master {body.host}")
    if refusal is not None:
        service.refuse(body.host, "another_broker", refusal)
        _refuse(request, body.host, f"refused the report of {refusal}", refusal)
    twin = service.owners.refusal(body.host, body.master, service.clock(),
                                  service.state.expiry_s(body.interval_s))
    if twin is not None:
        service.refuse(body.host, "two_masters", twin)
        _refuse(request, f"{body.host} {body.master}", f"refused a report: {twin}", twin)
    if service.learned is not None:
        service.learned.learn(body.host, body.periodic)
    reply = service.try_receive(body)
    return reply if reply is not None else await run_in_threadpool(service.receive, body)


def _refuse(request: Request, key: str, line: str, detail: str) -> NoReturn:
    """409 with ``detail``; ``line`` logged once per ``key`` (every report is refused)."""
    refused: set[str] | None = getattr(request.app.state, "refused_hosts", None)
    if refused is None:
        refused = request.app.state.refused_hosts = set()
    if key not in refused:
        refused.add(key)
        logger.error("%s", line)
    raise HTTPException(409, detail)


class ReportRoute(APIRoute):
    """The report route, answering a valid, authorised JSON report without FastAPI's
    reading of the body (``json.loads``, then every queue policy validated again: most of a
    report's CPU at 150 queues; manager/api/report_body.py). Anything else (a refused
    token, a body that does not validate, another content type, overridden dependencies)
    goes through FastAPI's handler, which answers it as before; so does the OpenAPI
    document, made from the route as declared. The reply is the bytes FastAPI sends."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        generic = super().get_route_handler()
        reader = ReportReader()

        async def handle(request: Request) -> Response:
            quick = await _quick_reply(request, reader)
            return quick if quick is not None else await generic(request)

        return handle


async def _quick_reply(request: Request, reader: ReportReader) -> Response | None:
    """The reply to a report that needs nothing but reading; None: FastAPI's handler."""
    if (request.headers.get("content-type") != "application/json"
            or request.app.dependency_overrides):
        return None
    service = request.app.state.service
    try:
        await reporter_authorised(request, service, request.headers.get("authorization"))
    except HTTPException:
        return None
    body = reader.read(await request.body())
    if body is None:
        return None
    reply = await report(body, service, request)
    return Response(reply.__pydantic_serializer__.to_json(reply), media_type="application/json")


router.add_api_route(REPORTS_PATH, report, methods=["POST"],
                     dependencies=[Depends(reporter_authorised)],
                     route_class_override=ReportRoute)


@router.post("/api/v1/hosts/{host}/leave", dependencies=[Depends(reporter_authorised)])
def leave(host: NamePath, service: ServiceDep) -> dict[str, Any]:
    """A master stopping cleanly (SIGTERM, ``systemctl stop``, a scale-down) leaves the
    cluster: its host goes from the view and ``/metrics`` at once instead of staying DEAD,
    ``qcluster_host_up`` 0, for as long as the manager runs. Its next report, if it starts
    again, brings it back. ``left``: whether the host was known."""
    return {"host": host, "left": service.leave(host)}


@router.get("/api/v1/identity")
def identity(request: Request) -> dict[str, Any]:
    """The broker this manager works on: its cluster identity and masked URL (null: not
    known, a broker without a controls store)."""
    claim = getattr(request.app.state, "cluster", None)
    return {"cluster": None if claim is None else claim.model_dump()}
