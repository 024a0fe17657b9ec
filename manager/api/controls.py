"""The operator's controls: pause and resume a queue, drain and undrain a host (kept in
the broker; 503 when it did not store the change), and requeue a queue's dead jobs."""

from __future__ import annotations

import difflib
from typing import Any

from fastapi import APIRouter, Depends

from qcluster.manager.api.deps import GUARDED, NamePath, ServiceDep, actor, stored
from qcluster.manager.service import ManagerService

router = APIRouter(tags=["control"])


@router.get("/api/v1/controls")
def controls(service: ServiceDep) -> list[dict[str, Any]]:
    """Pauses and drains in force, each with who (the token's name) and when."""
    return [c.model_dump() for c in service.controls()]


@router.post("/api/v1/queues/{queue}/pause")
def pause(queue: NamePath, service: ServiceDep, by: str = Depends(actor)) -> dict[str, Any]:
    """Plan no slot for the queue until it is resumed (kept in the broker: a restarted
    manager keeps it)."""
    control = stored(lambda: service.pause(queue, by))
    return {"queue": queue, "paused": True, "by": control.by, "at": control.at,
            **_known(service, "pause", queue)}


@router.post("/api/v1/queues/{queue}/resume", dependencies=GUARDED)
def resume(queue: NamePath, service: ServiceDep) -> dict[str, Any]:
    stored(lambda: service.resume(queue))
    return {"queue": queue, "paused": False}


@router.post("/api/v1/queues/{queue}/requeue-dead", dependencies=GUARDED)
def requeue_dead(queue: NamePath, service: ServiceDep) -> dict[str, Any]:
    return {"queue": queue, "requeued": service.requeue_dead(queue)}


@router.post("/api/v1/hosts/{host}/drain")
def drain(host: NamePath, service: ServiceDep, by: str = Depends(actor)) -> dict[str, Any]:
    """Plan no slot on the host (its slots move to the others) until it is undrained
    (kept in the broker: a restarted manager keeps it)."""
    control = stored(lambda: service.drain(host, by))
    return {"host": host, "drained": True, "by": control.by, "at": control.at,
            **_known(service, "drain", host)}


@router.post("/api/v1/hosts/{host}/undrain", dependencies=GUARDED)
def undrain(host: NamePath, service: ServiceDep) -> dict[str, Any]:
    stored(lambda: service.undrain(host))
    return {"host": host, "drained": False}


def _known(service: ManagerService, kind: str, name: str) -> dict[str, Any]:
    """Whether a master has reported the name, and the closest names that were: a typo
    (``mial``) is stored and shown as done, but pauses or drains nothing."""
    names = service.known_names(kind)
    if name in names:
        return {"known": True, "like": []}
    return {"known": False, "like": difflib.get_close_matches(name, sorted(names), n=3)}
