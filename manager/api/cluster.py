"""What the cluster looks like: the view the admin page shows, and a queue's history."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException
from fastapi.responses import JSONResponse

from qcluster.manager.api.deps import NamePath, ServiceDep
from qcluster.messages import HistoryPoint
from qcluster.names import closest

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


@router.get("/api/v1/queues/{queue}/history",
            responses={404: {"description": "no queue of that name is known"}})
def history(queue: NamePath, service: ServiceDep) -> list[HistoryPoint]:
    """The queue's last hour, one point per round; 404 for a name no master, no policy
    and no round has known (a typo would otherwise read as a queue with no history)."""
    points = service.queue_history(queue)
    if points:
        return points
    known = service.known_names("pause")
    if queue not in known:
        like = closest(queue, known)
        hint = f" (did you mean {like!r}?)" if like else ""
        raise HTTPException(404, f"no queue {queue!r} is known to this manager{hint}")
    return points
