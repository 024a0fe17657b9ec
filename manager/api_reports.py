"""``POST /api/v1/reports``: a master's report, answered with its row of the slot map."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from qcluster.manager.api_deps import ServiceDep, reporter_authorised
from qcluster.messages import Assignment, HostReport

router = APIRouter(tags=["masters"])


@router.post("/api/v1/reports", dependencies=[Depends(reporter_authorised)])
def report(body: HostReport, service: ServiceDep) -> Assignment:
    """A master's report; the reply is its row of the slot map."""
    return service.receive(body)
