"""Rolling code reload: one host's, every reporting host's, and the rollout's progress."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, HTTPException
from fastapi.responses import JSONResponse

from qcluster.manager.api.deps import NamePath, ServiceDep, actor
from qcluster.manager.service import ManagerService, ReloadRefused

router = APIRouter(tags=["reload"])


def _reloading(service: ManagerService, host: str | None, by: str) -> dict[str, Any]:
    try:
        return service.reload(host, by)
    except ReloadRefused as exc:
        raise HTTPException(exc.status, str(exc)) from None


@router.post("/api/v1/hosts/{host}/reload")
def reload_host(host: NamePath, service: ServiceDep,
                by: str = Depends(actor)) -> dict[str, Any]:
    """Ask the host's master to reload its code (a fresh template, slots replaced a few
    at a time): its next reply carries a new ``reload_id``. Answers the rollout; 404 an
    unknown host, 409 the host not reporting or a reload already running."""
    return _reloading(service, host, by)


@router.post("/api/v1/reload")
def reload_all(service: ServiceDep, by: str = Depends(actor)) -> dict[str, Any]:
    """Reload every reporting host, one at a time by name: the next host is asked once
    the previous one took the new code (or was skipped: it stopped reporting, or did
    not take the request up within 30 s); a host that fails stops the rollout. 409 when
    a reload is running or no host reports."""
    return _reloading(service, None, by)


@router.get("/api/v1/reload")
def reload_status(service: ServiceDep) -> JSONResponse:
    """The rolling reload running, or the last one (null: none since the manager
    started): each host's step (waiting, asked, took, failed, skipped) and note."""
    return JSONResponse(service.reload_status())
