"""Liveness (``/healthz``) and the Prometheus gauges (``/metrics``)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from qcluster.manager.api.deps import ServiceDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz(service: ServiceDep) -> dict[str, str]:
    """Liveness, always 200: ``{"status": "ok"}``, or ``{"status": "degraded", "broker":
    REASON}`` while the planning loop's last broker read failed."""
    return service.health()


@router.get("/metrics")
def metrics(service: ServiceDep) -> Response:
    from qcluster.manager.api.metrics import render

    body, content_type = render(service)
    return Response(body, media_type=content_type)
