"""What the cluster looks like: the view the admin page shows, and a queue's history."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from qcluster.manager.api.deps import NamePath, ServiceDep
from qcluster.messages import HistoryPoint

router = APIRouter(tags=["cluster"])


@router.get("/api/v1/cluster")
def cluster(service: ServiceDep) -> JSONResponse:
    """Queues, hosts, slot map and decisions (newest first); ``broker``: the broker's
    nodes (address, role, ok or the error, a Cluster master's hash slots) and the node
    serving each queue, as the last broker check read them (null before the first);
    ``reload``: the rolling reload running or the last one (null: none yet)."""
    body = service.cluster_view().model_dump(by_alias=True, mode="json")
    nodes = service.broker_nodes()
    body["broker"] = nodes.model_dump(mode="json") if nodes is not None else None
    body["reload"] = service.reload_status()
    return JSONResponse(body)


@router.get("/api/v1/queues/{queue}/history")
def history(queue: NamePath, service: ServiceDep) -> list[HistoryPoint]:
    return service.queue_history(queue)
